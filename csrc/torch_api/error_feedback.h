// compression="int8"'s error feedback (docs/design.md, "int8 across nodes"): what the roundings
// to int8 lost of each gradient bucket, kept between steps and added to the bucket's next
// all-reduce before it is rounded again, so nothing a rounding drops is lost, only delayed.
//
// A bucket is known by its index and its layout, the indices of its parameters among the model's.
// DDP rebuilds its buckets after the first step in the order the gradients arrived, and a bucket
// whose layout changed starts again from zero (the first step's residual is dropped: it is laid
// out as the old bucket was). state() and load() carry every bucket's residual through a
// checkpoint. A resumed DDP model's first step has one bucket of every parameter, which it
// rebuilds into the saved buckets after it: that bucket is reduced as the saved ones were, each
// gathered in its own order, so a resumed run goes on with the same bits as one that never
// stopped.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../collectives/collectives.h"

namespace ddpx {

class ErrorFeedback {
 public:
  // (bucket index, layout, residual values) of each bucket.
  using State = std::vector<std::tuple<int64_t, std::vector<int64_t>, at::Tensor>>;

  // parameters: the model's, in the order of model.parameters().
  explicit ErrorFeedback(const std::vector<at::Tensor>& parameters) {
    for (size_t i = 0; i < parameters.size(); ++i) {
      index_of_[parameters[i].unsafeGetTensorImpl()] = int64_t(i);
    }
  }

  // What a bucket is reduced as: the pieces of its buffer (offset, length in elements) that,
  // end to end, make one all-reduce, and its residual.
  struct Part {
    std::vector<std::pair<int64_t, int64_t>> pieces;
    std::shared_ptr<Residual> residual;
  };

  // The parts of this bucket: itself with its residual, zero where it is new or its layout
  // changed; or, where its parameters are those of saved buckets laid out otherwise, each of
  // those (its parameters gathered in its order) with its own.
  std::vector<Part> parts(const c10d::GradBucket& bucket) {
    std::vector<int64_t> layout;
    std::map<int64_t, std::pair<int64_t, int64_t>> place;  // parameter -> offset, length
    int64_t whole = 0;
    for (const at::Tensor& p : bucket.getParameters()) {
      const auto found = index_of_.find(p.unsafeGetTensorImpl());
      layout.push_back(found == index_of_.end() ? -1 : found->second);
      place[layout.back()] = {whole, p.numel()};
      whole += p.numel();
    }
    std::lock_guard<std::mutex> lock(mu_);
    Entry& entry = buckets_[int64_t(bucket.getIndex())];
    if (entry.residual && entry.layout == layout) {
      entry.loaded = false;
      return {{{{0, whole}}, entry.residual}};
    }
    // Only loaded buckets: a bucket DDP rebuilt out of this job's own is new, as said above.
    std::vector<Part> saved;
    std::vector<Entry*> used;
    int64_t covered = 0;
    for (auto& [index, other] : buckets_) {
      if (!other.loaded || !other.residual || other.layout.empty()) continue;
      Part part{{}, other.residual};
      for (const int64_t parameter : other.layout) {
        const auto at = place.find(parameter);
        if (at == place.end()) break;
        part.pieces.push_back(at->second);
        covered += at->second.second;
        place.erase(at);
      }
      if (part.pieces.size() != other.layout.size()) break;
      saved.push_back(std::move(part));
      used.push_back(&other);
    }
    if (!saved.empty() && covered == whole && place.empty()) {
      for (Entry* other : used) other->loaded = false;
      return saved;
    }
    entry = Entry{std::move(layout), std::make_shared<Residual>()};
    return {{{{0, whole}}, entry.residual}};
  }

  // A copy of every bucket's residual (call it between steps, when no bucket is in flight).
  State state() const {
    std::lock_guard<std::mutex> lock(mu_);
    State out;
    for (const auto& [index, entry] : buckets_) {
      const at::Tensor& values = entry.residual->values;
      out.emplace_back(index, entry.layout,
                       values.defined() ? values.clone() : at::empty({0}, at::kFloat));
    }
    return out;
  }

  void load(const State& state) {
    std::lock_guard<std::mutex> lock(mu_);
    buckets_.clear();
    for (const auto& [index, layout, values] : state) {
      auto residual = std::make_shared<Residual>();
      if (values.numel() > 0) residual->values = values.to(at::kFloat).contiguous().clone();
      buckets_[index] = Entry{layout, std::move(residual), /*loaded=*/true};
    }
  }

 private:
  struct Entry {
    std::vector<int64_t> layout;
    std::shared_ptr<Residual> residual;
    // From load(), and not reduced yet: the resumed model's first buckets are gathered into it.
    bool loaded = false;
  };
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of_;
  mutable std::mutex mu_;
  std::map<int64_t, Entry> buckets_;
};

}  // namespace ddpx
