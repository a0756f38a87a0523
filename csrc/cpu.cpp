// What the running CPU supports (so Python can pick a variant without parsing /proc/cpuinfo) and
// the kernels' thread pool (its count and counters).
#include <pybind11/pybind11.h>

#include <atomic>

#include "common.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace py = pybind11;

namespace tmk {
// CPUID leaf 7: AMX-TILE is EDX bit 24, AMX-INT8 bit 25 (gcc 12's __builtin_cpu_supports has no name for them).
static bool cpu_has_amx_int8() {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d >> 24 & 1) && (d >> 25 & 1);
#else
    return false;
#endif
}

// Linux hands out the 8 KB tile state only to a process that asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); a tile instruction without it is SIGILL. Asked once, for the
// whole process.
static bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
    static const bool granted = cpu_has_amx_int8() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                              18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
#else
    return false;
#endif
}

// Read by the kernel threads, switched from Python (tests flip it between calls).
static std::atomic<bool> g_amx{false};
static std::atomic<int64_t> g_amx_passes{0};
namespace qmm {
bool amx_enabled() { return g_amx.load(std::memory_order_relaxed); }
void count_amx_pass() { g_amx_passes.fetch_add(1, std::memory_order_relaxed); }
}  // namespace qmm

// Turns the AMX qmatmul on (where this variant carries it, the CPU has it and Linux grants it) or off;
// returns whether it is on. Off by default: kernels/native.py turns it on.
static bool set_amx(bool on) {
#if defined(TM_AMX)
    g_amx = on && amx_permitted();
#else
    (void)on;
    (void)amx_permitted;
    g_amx = false;
#endif
    return g_amx.load();
}
}  // namespace tmk

static py::dict cpu_features() {
    py::dict d;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    d["avx2"] = bool(__builtin_cpu_supports("avx2"));
    d["fma"] = bool(__builtin_cpu_supports("fma"));
    d["f16c"] = true;  // every AVX2 CPU has it; __builtin_cpu_supports cannot ask for it on older gcc
    d["avx512f"] = bool(__builtin_cpu_supports("avx512f"));
    d["avx512bw"] = bool(__builtin_cpu_supports("avx512bw"));
    d["avx512vl"] = bool(__builtin_cpu_supports("avx512vl"));
    d["avx512dq"] = bool(__builtin_cpu_supports("avx512dq"));
    d["avx512vnni"] = bool(__builtin_cpu_supports("avx512vnni"));
    d["avx512bf16"] = bool(__builtin_cpu_supports("avx512bf16"));
    d["amx_int8"] = tmk::cpu_has_amx_int8();
#endif
    return d;
}

void register_cpu(py::module_& m) {
    m.def("cpu_features", &cpu_features, "instruction-set extensions this CPU supports");
    m.def("set_num_threads", &tmk::set_num_threads, py::arg("n"));
    m.def("num_threads", &tmk::num_threads);
    m.def("set_amx", &tmk::set_amx, py::arg("on"), "turn the AMX-INT8 qmatmul on or off; returns whether it is on");
    m.def("amx", &tmk::qmm::amx_enabled, "whether qmatmul takes AMX-INT8 for whole groups of 16 rows");
    m.def("amx_passes", []() { return tmk::g_amx_passes.load(); }, "thread passes of qmatmul that took AMX so far");
    m.def("openmp", []() {
#ifdef _OPENMP
        return true;
#else
        return false;
#endif
    }, "whether this module was compiled with OpenMP (no longer: the kernels run on thread_pool.h)");
    m.def("pool_stats", []() {
        const tmk::pool::Stats s = tmk::pool::stats();
        py::dict d;
        d["regions"] = s.regions;            // parallel regions on more than one thread (dispatch + join each)
        d["inline"] = s.inline_calls;        // parallel calls that ran on the calling thread alone
        d["join_wait_ns"] = s.join_wait_ns;  // time callers waited at joins for the workers
        d["worker_sleeps"] = s.worker_sleeps;
        d["threads"] = s.threads;            // the pool's threads (workers + the caller); 1 before its first region
        d["omp_regions"] = 0;                // OpenMP is gone from the compiled core
        return d;
    }, "the thread pool's counters since process start (or reset_pool_stats)");
    m.def("reset_pool_stats", &tmk::pool::reset_stats, "zero the pool's cumulative counters");
}
