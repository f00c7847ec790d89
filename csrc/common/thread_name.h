// ddpx's threads carry names (`top -H`, `perf`, py-spy, gdb's `info threads` show them), so that
// a profile of a training job tells the engine's time from the model's.
#pragma once

#include <pthread.h>

namespace ddpx {

// Names the calling thread; Linux keeps 15 characters of it.
inline void name_this_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace ddpx
