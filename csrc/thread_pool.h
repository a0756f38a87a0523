// The compiled core's one CPU thread pool (thread_pool.cpp): persistent workers that the calling
// thread joins as worker 0, so a parallel region costs one dispatch and one join instead of an
// OpenMP fork-join. Each extension module (ISA variant) has its own pool, started on its first
// parallel region: a variant that is never used starts no threads.
//
// Regions run one at a time per process-module; a call from inside a region (nested) or with one
// thread runs inline on the calling thread. Workers never touch Python.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tmk {

// Threads the kernels use; set from Python (kernels.set_num_threads) so --threads is honoured. The
// pool follows it at its next region.
int num_threads();
void set_num_threads(int n);

namespace pool {

using Task = void (*)(void* ctx, int ith, int nth);

// task(ctx, i, n) once for each part i in [0, n), on up to n threads: the caller and the pool's
// workers take parts until none is left, and this returns when all have finished. n is clipped to
// num_threads(); with n <= 1 or inside a region it runs inline as task(ctx, 0, 1). An exception
// thrown by a part is rethrown here after the join (the first one).
void run(int n, Task task, void* ctx);

// Whether this thread is inside a parallel region (as the caller or a worker).
bool in_region();

// Counts a parallel_for that ran on the calling thread alone (too little work or one thread).
void count_inline();

struct Stats {
    int64_t regions, inline_calls, join_wait_ns, worker_sleeps, threads;
};
Stats stats();
void reset_stats();

}  // namespace pool

// fn(i, n) for each part i of n (see pool::run): n may come back smaller than asked (clipped to
// num_threads(), or 1 inline), and any thread may run any part.
template <typename Fn>
inline void run(int nth, Fn&& fn) {
    using F = std::remove_reference_t<Fn>;
    pool::run(nth, [](void* ctx, int ith, int n) { (*static_cast<F*>(ctx))(ith, n); },
              const_cast<void*>(static_cast<const void*>(&fn)));
}

// fn(begin, end) over [0, n) split into contiguous ranges, one per thread, on min(num_threads(),
// ceil(n / grain)) threads: a grain is the least work worth waking a thread for. A range's work never
// depends on how many threads there are, so results are the same for any thread count.
template <typename Fn>
inline void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    const int threads = chunks < num_threads() ? int(chunks) : num_threads();
    if (threads <= 1 || pool::in_region()) {
        pool::count_inline();
        fn(int64_t(0), n);
        return;
    }
    run(threads, [&](int part, int parts) {
        const int64_t per = (n + parts - 1) / parts, b = part * per, e = b + per < n ? b + per : n;
        if (b < e) fn(b, e);
    });
}

}  // namespace tmk
