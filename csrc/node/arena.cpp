// The arena (arena.h): chunks of anonymous shared memory, a free list, and the peers' chunks
// mapped here.
#include "arena.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shm_segment.h"

namespace ddpx {
namespace {

// Chunks are whole pages, and large ones whole huge pages' worth, so one chunk's growth never
// needs another of nearly the same size.
constexpr size_t kLargeChunk = size_t(2) << 20;

size_t chunk_bytes_for(size_t bytes) {
  return round_up(std::max<size_t>(bytes, 1), bytes >= kLargeChunk / 2 ? kLargeChunk : kPage);
}

std::string errno_text(const char* call) {
  return std::string(call) + " failed: " + std::strerror(errno);
}

}  // namespace

Arena& Arena::process() {
  // Never destroyed: tensors in it may outlive every static.
  static Arena* const arena = new Arena();
  return *arena;
}

void Arena::probe() {
  if (probed_) return;
  probed_ = true;
  const int fd = int(syscall(SYS_memfd_create, "ddpx-arena", MFD_CLOEXEC));
  if (fd < 0) {
    why_not_ = errno_text("memfd_create");
    return;
  }
  close(fd);
  const int pidfd = int(syscall(SYS_pidfd_open, getpid(), 0));
  if (pidfd < 0) {
    why_not_ = errno_text("pidfd_open");
    return;
  }
  close(pidfd);
}

bool Arena::usable() {
  std::lock_guard<std::mutex> lock(mutex_);
  probe();
  return why_not_.empty();
}

const std::string& Arena::why_not() {
  std::lock_guard<std::mutex> lock(mutex_);
  probe();
  return why_not_;
}

Arena::Chunk* Arena::take(size_t bytes) {
  const size_t want = chunk_bytes_for(bytes);
  Chunk* best = nullptr;
  for (auto& [base, chunk] : chunks_) {
    if (chunk.in_use || chunk.bytes < want || chunk.bytes > 2 * want) continue;
    if (best == nullptr || chunk.bytes < best->bytes) best = &chunk;
  }
  if (best != nullptr) {
    best->in_use = true;
    return best;
  }
  const int fd = int(syscall(SYS_memfd_create, "ddpx-arena", MFD_CLOEXEC));
  if (fd < 0) return nullptr;
  struct stat st{};
  // fallocate reserves the pages now, so memory running out is this call's failure, not a
  // SIGBUS in a later write.
  if (ftruncate(fd, off_t(want)) != 0 || fallocate(fd, 0, 0, off_t(want)) != 0 ||
      fstat(fd, &st) != 0) {
    close(fd);
    return nullptr;
  }
  void* base = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
  auto [it, inserted] =
      chunks_.emplace(reinterpret_cast<uintptr_t>(base),
                      Chunk{fd, uint64_t(st.st_ino), static_cast<char*>(base), want, true});
  return &it->second;
}

void Arena::release(void* chunk) {
  Arena& arena = process();
  std::lock_guard<std::mutex> lock(arena.mutex_);
  static_cast<Chunk*>(chunk)->in_use = false;
}

at::DataPtr Arena::take_data(size_t bytes, std::string* why) {
  std::lock_guard<std::mutex> lock(mutex_);
  probe();
  *why = why_not_;
  Chunk* chunk = why->empty() ? take(bytes) : nullptr;
  if (why->empty() && chunk == nullptr) *why = errno_text("making a chunk of shared memory");
  if (chunk == nullptr) return {};
  return at::DataPtr(chunk->base, chunk, &Arena::release, at::Device(at::kCPU));
}

at::Tensor Arena::allocate(int64_t numel, const at::TensorOptions& options) {
  TORCH_CHECK_VALUE(numel >= 0, "ddpx: cannot allocate ", numel, " elements");
  const size_t bytes = size_t(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  std::string why = "the tensor is for " + options.device().str() + ", the arena holds CPU tensors";
  // No bytes, no chunk: a tensor of no elements has nothing to share.
  if (bytes == 0) return at::empty({numel}, options);
  at::DataPtr data = options.device().is_cpu() ? take_data(bytes, &why) : at::DataPtr();
  if (!data) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!fell_back_) {
      fell_back_ = true;
      TORCH_WARN("ddpx: a tensor of ", bytes, " bytes for communication is in ordinary memory, ",
                 "not in ddpx's arena (", why, "): its collectives copy it in and out");
    }
    return at::empty({numel}, options);
  }
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), bytes,
                                                       std::move(data), nullptr, false);
  return at::empty({0}, options).set_(c10::Storage(std::move(storage)), 0, {numel}, {1});
}

bool Arena::adopt(const at::Tensor& t) {
  if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.has_storage()) return false;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  if (bytes == 0 || find(storage->data(), bytes).valid()) return bytes != 0;
  std::string why;
  at::DataPtr data = take_data(bytes, &why);
  if (!data) return false;
  std::memcpy(data.get(), storage->data(), bytes);
  storage->set_data_ptr_noswap(std::move(data));
  return true;
}

ArenaPlace Arena::find(const void* data, size_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = chunks_.upper_bound(address);
  if (it == chunks_.begin()) return {};
  --it;
  const Chunk& chunk = it->second;
  if (!chunk.in_use || address + bytes > it->first + chunk.bytes) return {};
  return {chunk.fd, chunk.inode, chunk.bytes, address - it->first};
}

char* Arena::peer_chunk(pid_t owner, const ArenaPlace& place, std::string* why) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto key = std::make_pair(owner, place.inode);
  if (auto it = peers_.find(key); it != peers_.end()) return it->second;
  auto pidfd = pidfds_.find(owner);
  if (pidfd == pidfds_.end()) {
    const int fd = int(syscall(SYS_pidfd_open, owner, 0));
    if (fd < 0) {
      *why = errno_text("pidfd_open");
      return nullptr;
    }
    pidfd = pidfds_.emplace(owner, fd).first;
  }
  const int fd = int(syscall(SYS_pidfd_getfd, pidfd->second, place.fd, 0));
  if (fd < 0) {
    *why = errno_text("pidfd_getfd");
    return nullptr;
  }
  struct stat st{};
  if (fstat(fd, &st) != 0 || uint64_t(st.st_ino) != place.inode ||
      size_t(st.st_size) != place.chunk_bytes) {
    close(fd);
    *why = "descriptor " + std::to_string(place.fd) + " of pid " + std::to_string(owner) +
           " is no longer the chunk its call named";
    return nullptr;
  }
  void* base = mmap(nullptr, place.chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    *why = errno_text("mmap");
    return nullptr;
  }
  peers_.emplace(key, static_cast<char*>(base));
  return static_cast<char*>(base);
}

Arena::Usage Arena::usage() {
  std::lock_guard<std::mutex> lock(mutex_);
  Usage usage;
  usage.chunks = chunks_.size();
  for (const auto& [base, chunk] : chunks_) {
    usage.bytes += chunk.bytes;
    if (chunk.in_use) usage.in_use += chunk.bytes;
  }
  usage.peer_chunks = peers_.size();
  usage.fell_back = fell_back_;
  return usage;
}

}  // namespace ddpx
