// The pool behind tmk::run / tmk::parallel_for (thread_pool.h).
//
// Dispatch: the caller writes the task, then bumps one 64-bit word on its own cache line, which
// holds a generation counter and the region's part count; workers wait for the word to change. A
// region's parts are taken from a claim counter (generation and next part, one compare-and-swap
// each) by whichever thread comes first, the caller included; the join waits only for the parts
// that workers took. So a worker that is asleep or preempted when the region starts holds nothing
// up: the caller runs its part too. With OpenMP, where each thread had its own share, single-stream
// decode on this 2-core box fell from 117 to 12 tokens/s at 2 threads while one other process
// compiled: every fork-join waited for a preempted thread. Which thread runs a part never changes
// what the part computes.
//
// Waiting: a worker spins (pause) for TOKENMILL_SPIN_US microseconds after its last task (default
// 50: the gaps between a decode step's kernels are a few microseconds, the gap between two steps is
// Python's work, hundreds), then sleeps on a futex of its own, which the caller wakes only when the
// worker is needed. So between steps the workers give their cores back to the engine thread, the
// HTTP event loop and the grammar mask worker, and a region on 4 of 16 threads wakes only 3.
//
// Several callers (two engines stepping at once in one process): regions run one at a time, under a
// mutex. The other caller sleeps in the mutex (it takes no core) until the region ends, then gets
// every thread for its own region. Running its region inline instead would put one more thread on
// the cores than there are, and a region's join then waits for a worker the scheduler preempted in
// the middle of its part. The mutex is not fair: a caller that runs region after region may keep it
// for a whole native call (one decode step) while the other waits, which still interleaves the two
// at step granularity and never deadlocks (a region never waits for another region).
//
// fork(): the child has none of the parent's workers. An atfork handler holds the mutex across the
// fork (so no region is half dispatched), and in the child drops the pool, which its next region
// starts afresh.
#include "thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <algorithm>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tmk {

static std::atomic<int> g_threads{1};
int num_threads() { return g_threads.load(std::memory_order_relaxed); }
void set_num_threads(int n) { g_threads.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

namespace pool {
namespace {

constexpr int kLine = 64;
constexpr int kMaxThreads = 0xFFFF;  // a region's thread count rides in the dispatch word's low 16 bits

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// Sleep while *word == expected (a spurious return is fine: callers recheck).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
    if (word->load() == expected) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

inline void futex_wake(std::atomic<uint32_t>* word) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
#else
    (void)word;
#endif
}

// Counters, each on its own line: the callers write the first three, the workers the fourth.
struct alignas(kLine) Counter {
    std::atomic<int64_t> value{0};
    void add(int64_t n) { value.fetch_add(n, std::memory_order_relaxed); }
};
Counter g_regions, g_inline, g_join_wait_ns, g_worker_sleeps;

thread_local bool t_in_region = false;

struct RegionScope {  // marks this thread inside a region, so nested calls run inline
    bool outer = t_in_region;
    RegionScope() { t_in_region = true; }
    ~RegionScope() { t_in_region = outer; }
};

int spin_us_from_env() {
    const char* s = std::getenv("TOKENMILL_SPIN_US");
    if (s == nullptr || *s == '\0') return 50;
    const long v = std::strtol(s, nullptr, 10);
    return v < 0 ? 0 : v > 1000000 ? 1000000 : int(v);
}

class Pool {
public:
    explicit Pool(int threads) : spin_(std::chrono::microseconds(spin_us_from_env())), slots_(size_t(threads)) {
        workers_.reserve(size_t(threads - 1));
        for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
    }

    // Stops and joins the workers (between regions: the caller holds the region mutex).
    ~Pool() {
        stop_.store(true, std::memory_order_relaxed);
        generation_ += 1;
        publish(int(slots_.size()));
        for (std::thread& t : workers_) t.join();
    }

    int threads() const { return int(slots_.size()); }

    // parts <= threads(); the caller holds the region mutex.
    void run(int parts, Task task, void* ctx) {
        task_ = task;
        ctx_ = ctx;
        error_ = nullptr;
        finished_.store(0, std::memory_order_relaxed);
        generation_ += 1;
        claim_.store(generation_ << 16, std::memory_order_release);  // part 0 is the next to take
        publish(parts);
        int mine;
        {
            RegionScope scope;
            mine = take_parts(generation_, parts);
        }
        join(parts - mine);
        if (error_) std::rethrow_exception(error_);
    }

private:
    struct alignas(kLine) Slot {
        std::atomic<uint32_t> sleeping{0};  // 1 while the worker sleeps (or is about to) on this word
    };

    // The region's word (seq_cst: pairs with a worker's announcement that it sleeps, see sleep()),
    // then a wake for each worker it needs that is asleep.
    void publish(int parts) {
        word_.store(generation_ << 16 | uint64_t(parts), std::memory_order_seq_cst);
        for (int i = 1; i < parts; ++i) {
            std::atomic<uint32_t>& s = slots_[size_t(i)].sleeping;
            if (s.load(std::memory_order_seq_cst) != 0 && s.exchange(0, std::memory_order_seq_cst) != 0)
                futex_wake(&s);
        }
    }

    // Runs parts of region `generation` until none is left to take; returns how many it ran. A
    // part is taken by a compare-and-swap that also checks the generation, so a worker that wakes
    // after its region has ended takes nothing (and never reads a task the next region rewrites).
    int take_parts(uint64_t generation, int parts) {
        const uint64_t tag = (generation << 16) >> 16;  // the generation bits the claim word keeps
        int ran = 0;
        uint64_t c = claim_.load(std::memory_order_acquire);
        while ((c >> 16) == tag && int(c & kMaxThreads) < parts) {
            if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
            try {
                task_(ctx_, int(c & kMaxThreads), parts);
            } catch (...) {
                keep_error(std::current_exception());
            }
            ++ran;
            c = claim_.load(std::memory_order_acquire);
        }
        return ran;
    }

    // Waits for the parts the workers took: spinning while they are on a core, yielding to them
    // once the wait runs past the spin time (one may have been preempted mid-part).
    void join(int theirs) {
        if (finished_.load(std::memory_order_acquire) == theirs) return;
        const auto start = Clock::now();
        auto yield_after = start + spin_;
        for (unsigned i = 1; finished_.load(std::memory_order_acquire) != theirs; ++i) {
            cpu_relax();
            if ((i & 63) == 0 && Clock::now() > yield_after) {
                std::this_thread::yield();
                yield_after = Clock::now();  // from now on, yield every check
            }
        }
        g_join_wait_ns.add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
    }

    void keep_error(std::exception_ptr e) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = e;
    }

    void work(int ith) {
        uint64_t seen = 0;
        auto spin_until = Clock::now() + spin_;
        for (;;) {
            uint64_t w = word_.load(std::memory_order_acquire);
            for (unsigned i = 1; w == seen; ++i) {
                cpu_relax();
                if (((i & 31) == 0 || spin_ == Clock::duration::zero()) && Clock::now() > spin_until) sleep(ith, seen);
                w = word_.load(std::memory_order_acquire);
            }
            seen = w;
            if (stop_.load(std::memory_order_relaxed)) return;
            const int parts = int(w & kMaxThreads);
            if (ith >= parts) continue;  // not needed: keep the spin time already counting
            int ran;
            {
                RegionScope scope;
                ran = take_parts(w >> 16, parts);
            }
            if (ran > 0) finished_.fetch_add(ran, std::memory_order_acq_rel);
            spin_until = Clock::now() + spin_;
        }
    }

    // Announce the sleep, then check the word once more: publish() stores the word before it reads
    // the announcement, both seq_cst, so either this check sees the new region or publish() sees the
    // announcement and wakes this worker.
    void sleep(int ith, uint64_t seen) {
        std::atomic<uint32_t>& s = slots_[size_t(ith)].sleeping;
        s.store(1, std::memory_order_seq_cst);
        if (word_.load(std::memory_order_seq_cst) != seen) {
            s.store(0, std::memory_order_relaxed);
            return;
        }
        g_worker_sleeps.add(1);
        while (s.load(std::memory_order_acquire) != 0) futex_wait(&s, 1);
    }

    const Clock::duration spin_;
    alignas(kLine) std::atomic<uint64_t> word_{0};
    alignas(kLine) std::atomic<uint64_t> claim_{0};  // generation << 16 | the next part to take
    alignas(kLine) std::atomic<int> finished_{0};    // parts the workers finished
    // Written by the caller before publish(), read by a worker only once it has taken a part.
    alignas(kLine) Task task_ = nullptr;
    void* ctx_ = nullptr;
    uint64_t generation_ = 0;
    std::atomic<bool> stop_{false};
    std::mutex error_mutex_;
    std::exception_ptr error_;
    std::vector<Slot> slots_;  // [0] unused: the caller never sleeps here
    std::vector<std::thread> workers_;
};

// Regions run one at a time (see the top of this file); the pool is replaced under this mutex when
// the thread count changes.
std::mutex g_region_mutex;
Pool* g_pool = nullptr;  // owned; deliberately not destroyed at exit (a region may still run then)
std::atomic<int> g_pool_threads{1};  // its thread count, for stats() without the mutex

void before_fork() { g_region_mutex.lock(); }
void after_fork_parent() { g_region_mutex.unlock(); }
void after_fork_child() {
    // The parent's workers do not exist here: nothing to stop or join. The pool's memory stays (its
    // std::thread objects must never be destroyed: they still look joinable).
    g_pool = nullptr;
    g_pool_threads.store(1, std::memory_order_relaxed);
    g_region_mutex.unlock();  // this thread locked it in before_fork
}

Pool& pool_of(int threads) {
    static const bool registered = pthread_atfork(before_fork, after_fork_parent, after_fork_child) == 0;
    (void)registered;
    if (g_pool != nullptr && g_pool->threads() != threads) {
        delete g_pool;
        g_pool = nullptr;
    }
    if (g_pool == nullptr) {
        g_pool = new Pool(threads);
        g_pool_threads.store(threads, std::memory_order_relaxed);
    }
    return *g_pool;
}

}  // namespace

bool in_region() { return t_in_region; }

void count_inline() { g_inline.add(1); }

void run(int nth, Task task, void* ctx) {
    const int threads = std::min(num_threads(), kMaxThreads);
    if (nth > threads) nth = threads;
    if (nth <= 1 || t_in_region) {
        count_inline();
        RegionScope scope;
        task(ctx, 0, 1);
        return;
    }
    std::lock_guard<std::mutex> lock(g_region_mutex);
    Pool& p = pool_of(threads);
    g_regions.add(1);
    p.run(nth, task, ctx);
}

Stats stats() {
    return {g_regions.value.load(), g_inline.value.load(), g_join_wait_ns.value.load(), g_worker_sleeps.value.load(),
            g_pool_threads.load()};
}

void reset_stats() {
    for (Counter* c : {&g_regions, &g_inline, &g_join_wait_ns, &g_worker_sleeps}) c->value.store(0);
}

}  // namespace pool
}  // namespace tmk
