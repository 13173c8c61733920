// thread_pool.hpp — the CPU backend's persistent worker pool.
//
// parallel_run(n, fn) calls fn(worker) for worker = 0..n-1, worker 0 on the
// calling thread, and returns when all are done. Work is partitioned by the
// caller (docs/spec.md §15: each worker owns a contiguous range), so results
// never depend on scheduling. Exceptions are not allowed to escape fn: every
// argument is checked before a kernel runs.
#pragma once

#include <functional>

namespace padmoe {
namespace cpu {

// Worker count for Options::num_threads (0 = every hardware thread).
int resolve_threads(int requested);

void parallel_run(int workers, const std::function<void(int)>& fn);

}  // namespace cpu
}  // namespace padmoe
