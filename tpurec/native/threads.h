// Threads for tpurec's native code: how many it may use, and work sharing (xla_workers.h
// gives the XLA kernels their threads).

#ifndef TPUREC_NATIVE_THREADS_H_
#define TPUREC_NATIVE_THREADS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include <sched.h>

namespace tpurec_native {

// How many threads a kernel may use: TPUREC_CPU_THREADS, else the CPUs this process may run on.
inline int ConfiguredThreads() {
  if (const char* env = std::getenv("TPUREC_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);  // respects taskset/cgroup cpusets, unlike hardware_concurrency
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Runs fn(task) for task in [0, tasks) on the calling thread and on up to `helpers`
// more threads obtained with schedule(job), a callable that runs job() later on some
// thread (XLA's intra-op pool, which also runs the program's other thunks: sharing it
// keeps the cores from being oversubscribed). Tasks are taken from a shared counter,
// so a helper that starts late, or never, only takes fewer: the caller waits for the
// tasks that started, never for a helper to start, and cannot deadlock on a busy pool.
template <typename Schedule>
void ShareWork(int64_t tasks, int helpers, const std::function<void(int64_t)>& fn, Schedule&& schedule) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t tasks = 0;
    const std::function<void(int64_t)>* fn = nullptr;  // read only while tasks remain
    std::mutex mu;
    std::condition_variable all_done;
  };
  auto shared = std::make_shared<Shared>();
  shared->tasks = tasks;
  shared->fn = &fn;
  auto work = [shared] {
    for (int64_t t; (t = shared->next.fetch_add(1)) < shared->tasks;) {
      (*shared->fn)(t);
      if (shared->done.fetch_add(1) + 1 == shared->tasks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->all_done.notify_all();
      }
    }
  };
  for (int h = 0; h < helpers && h + 1 < tasks; ++h) schedule(work);
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load() == shared->tasks; });
}

}  // namespace tpurec_native

#endif  // TPUREC_NATIVE_THREADS_H_
