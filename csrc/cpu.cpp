// What the running CPU supports (so Python can pick a variant without parsing /proc/cpuinfo) and
// the kernels' thread count.
#include <pybind11/pybind11.h>

#include "common.h"

namespace py = pybind11;

namespace tmk {
static int g_threads = 1;
int num_threads() { return g_threads; }
void set_num_threads(int n) { g_threads = n < 1 ? 1 : n; }
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
#endif
    return d;
}

void register_cpu(py::module_& m) {
    m.def("cpu_features", &cpu_features, "instruction-set extensions this CPU supports");
    m.def("set_num_threads", &tmk::set_num_threads, py::arg("n"));
    m.def("num_threads", &tmk::num_threads);
    m.def("openmp", []() {
#ifdef _OPENMP
        return true;
#else
        return false;
#endif
    });
}
