// The extension module of one ISA variant (setup.py builds this file set three times). Each kernel
// family registers its own functions; they take raw addresses, shapes and strides of tensors that
// Python owns, and release the GIL while they run.
#include <pybind11/pybind11.h>

#include <string>

#include "common.h"

namespace py = pybind11;

void register_cpu(py::module_& m);
void register_qmatmul(py::module_& m);
void register_paged_attention(py::module_& m);
void register_fused_ops(py::module_& m);
void register_decoder_step(py::module_& m);
void register_token_mask(py::module_& m);
void register_argmax(py::module_& m);
void register_categorical(py::module_& m);
void register_nucleus(py::module_& m);
void register_penalties(py::module_& m);
void register_topk(py::module_& m);
void register_topk_draw(py::module_& m);
void register_logsumexp(py::module_& m);
void register_embedding(py::module_& m);
void register_head_argmax(py::module_& m);

PYBIND11_MODULE(TOKENMILL_MODULE, m) {
    m.doc() = "tokenmill's compiled CPU kernels (one ISA variant)";
    m.attr("variant") = std::string(TOKENMILL_VARIANT);
    register_cpu(m);
    register_qmatmul(m);
    register_paged_attention(m);
    register_fused_ops(m);
    register_decoder_step(m);
    register_token_mask(m);
    register_argmax(m);
    register_categorical(m);
    register_nucleus(m);
    register_penalties(m);
    register_topk(m);
    register_topk_draw(m);
    register_logsumexp(m);
    register_embedding(m);
    register_head_argmax(m);
}
