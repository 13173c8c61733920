// thread_pool.cpp — a persistent pool: threads are started once and parked on
// a condition variable between ops, so an op costs a wake-up, not a spawn.
#include "cpu/thread_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace padmoe {
namespace cpu {
namespace {

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(int workers, const std::function<void(int)>& fn) {
    if (workers <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);  // one op at a time uses the pool
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (static_cast<int>(threads_.size()) < workers - 1) {
        const int id = static_cast<int>(threads_.size()) + 1;
        threads_.emplace_back([this, id] { loop(id); });
      }
      fn_ = &fn;
      active_ = workers;
      pending_ = workers - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= active_) continue;  // not needed for this op
        fn = fn_;
      }
      (*fn)(id);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// The process's pool. A forked child inherits the parent's Pool object but
// none of its threads: the atfork child handler drops the pointer (the old
// pool is leaked on purpose: its std::thread objects name threads that do
// not exist in the child, and joining or destroying them would hang or
// terminate), so the child's first parallel op starts a pool of its own.
// The pool is never destroyed: parked workers need no teardown at exit.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mu;

void pool_prepare_fork() { g_pool_mu.lock(); }
void pool_parent_after_fork() { g_pool_mu.unlock(); }
void pool_child_after_fork() {
  g_pool.store(nullptr, std::memory_order_relaxed);
  g_pool_mu.unlock();
}

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  p = g_pool.load(std::memory_order_relaxed);
  if (p == nullptr) {
    static const bool registered =
        pthread_atfork(pool_prepare_fork, pool_parent_after_fork, pool_child_after_fork) == 0;
    (void)registered;
    p = new Pool();
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

int resolve_threads(int requested) {
  // Read once: glibc answers hardware_concurrency() by reading sysfs, several
  // syscalls that cost more than a whole op on a small workload.
  static const int hw = [] {
    const unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
  }();
  // Options::num_threads is capped at the hardware threads: more would only leave idle pool
  // threads alive for the life of the process.
  return requested > 0 ? std::min(requested, hw) : hw;
}

void parallel_run(int workers, const std::function<void(int)>& fn) { pool().run(workers, fn); }

}  // namespace cpu
}  // namespace padmoe
