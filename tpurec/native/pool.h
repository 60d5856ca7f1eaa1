// A persistent worker pool shared by tpurec's native XLA:CPU kernels.
//
// One pool per process (the function-local static below is shared by every
// translation unit of the library): kernels that XLA runs concurrently queue
// on it instead of each spawning threads and oversubscribing the cores.

#ifndef TPUREC_NATIVE_POOL_H_
#define TPUREC_NATIVE_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include <sched.h>

namespace tpurec_native {

// Thread pool: persistent workers (spawning threads per call costs more than a
// small forward pass). Calls are serialized: XLA may run two handlers at once.

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

class Pool {
 public:
  static Pool& Get() {
    // Leaked on purpose: workers outlive static destruction at process exit.
    static Pool* pool = new Pool(ConfiguredThreads());
    return *pool;
  }

  int size() const { return size_; }

  // Runs fn(worker) for worker in [0, n) (the caller is worker 0) and waits.
  void Run(int n, const std::function<void(int)>& fn) {
    n = std::min(n, size_);
    if (n <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> call(call_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      active_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  explicit Pool(int size) : size_(size) {
    for (int id = 1; id < size_; ++id) std::thread([this, id] { Work(id); }).detach();
  }

  void Work(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= active_) continue;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(id);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  const int size_;
  std::mutex call_mu_, mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0, pending_ = 0;
};

// Runs fn(task) for task in [0, tasks), spread over at most max_threads threads.
inline void ParallelFor(int64_t tasks, int max_threads, const std::function<void(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  int threads = static_cast<int>(std::min<int64_t>(tasks, max_threads));
  Pool::Get().Run(threads, [&](int) {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) fn(t);
  });
}

}  // namespace tpurec_native

#endif  // TPUREC_NATIVE_POOL_H_
