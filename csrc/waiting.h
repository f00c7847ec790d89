// The primitives a rank waits with on words in shared memory: a pause for spinning, and a futex
// to sleep on a word until another process changes it.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace ddpx {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be plain");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Sleeps while *word == expected, for at most timeout; the word may live in another process's
// mapping of the same shared memory (no FUTEX_PRIVATE_FLAG).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected,
                       std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = time_t(timeout.count() / 1000000000);
  ts.tv_nsec = long(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace ddpx
