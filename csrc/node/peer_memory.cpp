// Reaching a peer's memory through the kernel (peer_memory.h).
#include "peer_memory.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shm_channel.h"

namespace ddpx {

PeerMemory::PeerMemory(ShmChannel& channel) : channel_(channel), probe_word_(uint64_t(getpid())) {
  channel_.memory_words(channel_.me()).probe_address = reinterpret_cast<uint64_t>(&probe_word_);
}

void PeerMemory::transfer(PeerCopy copy, const char* verb, int rank, void* local_bytes,
                          uint64_t remote_address, size_t bytes, const std::string& what) const {
  const pid_t pid = channel_.pid(rank);
  for (size_t done = 0; done < bytes;) {
    iovec local{static_cast<char*>(local_bytes) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(remote_address + done), bytes - done};
    const ssize_t n = copy(pid, &local, 1, &remote, 1, 0);
    if (n <= 0) {
      const int error = errno;
      channel_.fail("ddpx: " + channel_.rank_name(channel_.me()) + " could not " + verb + " " +
                    std::to_string(bytes) + " bytes of " + channel_.rank_name(rank) +
                    "'s tensor (pid " + std::to_string(pid) + ") for " + what + ": " +
                    std::strerror(error) + (error == ESRCH ? " (the process has exited)" : ""));
    }
    done += size_t(n);
  }
}

void PeerMemory::read(int rank, void* to, uint64_t from, size_t bytes,
                      const std::string& what) const {
  transfer(process_vm_readv, "read", rank, to, from, bytes, what);
}

void PeerMemory::write(int rank, uint64_t to, const void* from, size_t bytes,
                       const std::string& what) const {
  // process_vm_writev only reads the local bytes.
  transfer(process_vm_writev, "write", rank, const_cast<void*>(from), to, bytes, what);
}

void PeerMemory::probe() {
  std::string because;
  for (int r = 0; r < channel_.size() && because.empty(); ++r) {
    if (r == channel_.me()) continue;
    if (!channel_.same_pid_namespace(r)) {
      because = channel_.rank_name(r) + " runs in another pid namespace";
      continue;
    }
    const pid_t pid = channel_.pid(r);
    uint64_t word = 0;
    errno = 0;
    iovec local{&word, sizeof word};
    iovec remote{reinterpret_cast<void*>(channel_.memory_words(r).probe_address), sizeof word};
    if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof word) ||
        word != uint64_t(pid) ||
        process_vm_writev(pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof word)) {
      because = "process_vm_readv/writev to " + channel_.rank_name(r) +
                " failed: " + std::strerror(errno ? errno : EIO);
    }
  }
  unreachable_because_ = because;
  probed_ = true;
  channel_.memory_words(channel_.me())
      .reach.store(int32_t(because.empty() ? Reach::Yes : Reach::No), std::memory_order_release);
}

bool PeerMemory::reaches_peers() const {
  return Reach(channel_.memory_words(channel_.me()).reach.load(std::memory_order_acquire)) ==
         Reach::Yes;
}

PeerMemory::Reach PeerMemory::reachable() const {
  Reach all = Reach::Yes;
  for (int r = 0; r < channel_.size(); ++r) {
    const auto reach = Reach(channel_.memory_words(r).reach.load(std::memory_order_acquire));
    if (reach == Reach::No) return Reach::No;
    if (reach == Reach::Unknown) all = Reach::Unknown;
  }
  return all;
}

}  // namespace ddpx
