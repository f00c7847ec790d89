// Creating, attaching and unlinking a named shared-memory segment (shm_segment.h).
#include "shm_segment.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ddpx {
namespace {

[[noreturn]] void system_error(const std::string& what, int err) {
  TORCH_CHECK(false, "ddpx: ", what, ": ", std::strerror(err));
}

}  // namespace

std::shared_ptr<ShmSegment> ShmSegment::create(const std::string& name, size_t bytes,
                                               const std::vector<NumaRange>& placement) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) system_error("cannot create shared memory " + name, errno);
  // Mapped before its pages exist, so that the placement's policies decide where fallocate puts
  // them.
  int err = ftruncate(fd, off_t(bytes)) == 0 ? 0 : errno;
  void* p = err == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (err == 0 && p == MAP_FAILED) err = errno;
  std::string not_placed;
  if (err == 0 && !placement.empty()) not_placed = numa_place(static_cast<char*>(p), placement);
  if (err == 0) err = posix_fallocate(fd, 0, off_t(bytes));
  close(fd);
  if (err != 0) {
    if (p != MAP_FAILED) munmap(p, bytes);
    shm_unlink(name.c_str());
    system_error(
        "cannot reserve " + std::to_string(bytes >> 20) + " MiB of shared memory in /dev/shm", err);
  }
  auto segment = std::shared_ptr<ShmSegment>(new ShmSegment(static_cast<char*>(p), bytes));
  segment->not_placed_ = std::move(not_placed);
  return segment;
}

std::shared_ptr<ShmSegment> ShmSegment::attach(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) system_error("cannot open shared memory " + name, errno);
  struct stat st{};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    TORCH_CHECK(false, "ddpx: shared memory ", name, " has ", st.st_size, " bytes, expected ",
                bytes);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) system_error("cannot map shared memory " + name, err);
  return std::shared_ptr<ShmSegment>(new ShmSegment(static_cast<char*>(p), bytes));
}

void ShmSegment::unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmSegment::~ShmSegment() { munmap(data_, size_); }

}  // namespace ddpx
