// Placeholder until this kernel family lands.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_paged_attention(py::module_&) {}
