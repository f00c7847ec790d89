// A named POSIX shared-memory segment, mapped into this process.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace ddpx {

// What the layouts in a segment align their parts to.
constexpr size_t kPage = 4096;
inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// The creator reserves its pages up front (fallocate), so a full /dev/shm fails here with a
// message instead of a SIGBUS later.
class ShmSegment {
 public:
  static std::shared_ptr<ShmSegment> create(const std::string& name, size_t bytes);
  static std::shared_ptr<ShmSegment> attach(const std::string& name, size_t bytes);
  // Removes the name; mappings stay valid. Safe to call for a name that is already gone.
  static void unlink(const std::string& name);

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  ShmSegment(char* data, size_t size) : data_(data), size_(size) {}
  char* data_;
  size_t size_;
};

}  // namespace ddpx
