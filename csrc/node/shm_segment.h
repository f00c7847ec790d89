// A named POSIX shared-memory segment, mapped into this process.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "numa.h"

namespace ddpx {

// What the layouts in a segment align their parts to.
constexpr size_t kPage = 4096;
inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// The creator reserves its pages up front (fallocate), so a full /dev/shm fails here with a
// message instead of a SIGBUS later; ranges given a NUMA policy (numa.h) have it before then, so
// their pages are allocated where it says.
class ShmSegment {
 public:
  static std::shared_ptr<ShmSegment> create(const std::string& name, size_t bytes,
                                            const std::vector<NumaRange>& placement = {});
  static std::shared_ptr<ShmSegment> attach(const std::string& name, size_t bytes);
  // Removes the name; mappings stay valid. Safe to call for a name that is already gone.
  static void unlink(const std::string& name);

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Why the placement create was given did not take (its pages lie where they would have
  // without it); empty where it did, or where none was asked for.
  const std::string& not_placed() const { return not_placed_; }

 private:
  ShmSegment(char* data, size_t size) : data_(data), size_(size) {}
  char* data_;
  size_t size_;
  std::string not_placed_;
};

}  // namespace ddpx
