// The threads a native kernel works on: XLA's intra-op thread pool for the call.
//
// XLA:CPU runs a program's thunks on that pool; a kernel that shares it (rather
// than waking threads of its own) does not compete with a concurrent thunk for the
// same cores. TPUREC_CPU_THREADS caps the threads a kernel asks for.

#ifndef TPUREC_NATIVE_XLA_WORKERS_H_
#define TPUREC_NATIVE_XLA_WORKERS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "threads.h"

namespace tpurec_native {

class XlaWorkers {
 public:
  explicit XlaWorkers(xla::ffi::ThreadPool& pool) : pool_(pool) {}

  // Threads available to this call (at least 1).
  int Size() const {
    const int64_t n = std::min<int64_t>(pool_.num_threads(), ConfiguredThreads());
    return static_cast<int>(std::max<int64_t>(n, 1));
  }

  // Runs fn(task) for task in [0, tasks) on at most `threads` threads (the caller is one).
  void For(int64_t tasks, int threads, const std::function<void(int64_t)>& fn) const {
    ShareWork(tasks, std::max(threads, 1) - 1, fn, [this](auto job) { pool_.Schedule(std::move(job)); });
  }

 private:
  xla::ffi::ThreadPool& pool_;
};

}  // namespace tpurec_native

#endif  // TPUREC_NATIVE_XLA_WORKERS_H_
