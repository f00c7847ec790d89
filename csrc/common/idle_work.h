// Work a thread takes up where it would otherwise block: the engine's thread runs the optimizer's
// steps of reduced buckets (register_fused_hook(optimizer=...)) while it waits for the link, and
// when it has no collective to run, so that they fill its idle time instead of taking cores from
// the node's own work.
#pragma once

#include <chrono>
#include <functional>

namespace ddpx {

// This thread's idle work: runs one piece and says whether there was one. Empty on threads that
// have none.
inline thread_local std::function<bool()> idle_work;

// Runs a piece of this thread's idle work, if it has one; returns the seconds it took (0: none).
inline double run_idle_work() {
  if (!idle_work) return 0;
  const auto start = std::chrono::steady_clock::now();
  if (!idle_work()) return 0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ddpx
