// Writes a step's K/V rows (fp32 [T, Hkv, D], any token and head strides) into their cache slots,
// converting to the cache dtype: fp32 as is, bf16 and fp16 rounded to nearest even, int8 symmetric with one
// scale per (token, head): scale = absmax / 127, q = round_half_even(x / scale), stored alongside.
// Written to match kernels/attention.py's write_kv_reference bit for bit.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"

namespace py = pybind11;

namespace tmk {
namespace {

struct Source {
    const float* data;
    int64_t row_stride, head_stride;
};

void write_row(const float* x, int D, int cache_type, void* cache, float* scale, int64_t row) {
    if (cache_type == 0) {
        std::memcpy(static_cast<float*>(cache) + row * D, x, sizeof(float) * D);
    } else if (cache_type == 1) {
        uint16_t* dst = static_cast<uint16_t*>(cache) + row * D;
        for (int d = 0; d < D; ++d) dst[d] = f32_to_bf16(x[d]);
    } else if (cache_type == 3) {
        uint16_t* dst = static_cast<uint16_t*>(cache) + row * D;
        int d = 0;
#if defined(TM_AVX512) || defined(TM_AVX2)
        for (; d + 8 <= D; d += 8)  // F16C: the same rounding, 8 at a time
            _mm_storeu_si128((__m128i*)(dst + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; d < D; ++d) dst[d] = f32_to_f16(x[d]);
    } else {
        float amax = 0.0f;
        for (int d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(x[d]));
        const float s = amax / 127.0f, divisor = s > 0.0f ? s : 1.0f;
        int8_t* dst = static_cast<int8_t*>(cache) + row * D;
        for (int d = 0; d < D; ++d) {
            float r = std::nearbyint(x[d] / divisor);  // default rounding mode: half to even, as torch.round
            dst[d] = int8_t(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        scale[row] = s;
    }
}

void check_kv_write(int64_t T, int cache_type, int64_t num_slots, const int64_t* slots) {
    if (cache_type < 0 || cache_type > 3) throw std::invalid_argument("bad cache type");
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) throw std::out_of_range("slot " + std::to_string(slots[t]) + " out of range");
}

// Items [begin, end) of the flat (token, head) list: item i is token i / Hkv, head i % Hkv.
void write_items(const Source& ks, const Source& vs, int Hkv, int D, void* kc, void* vc, float* kscale, float* vscale,
                 int cache_type, int64_t num_slots, const int64_t* slots, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / Hkv, h = i % Hkv;
        if (slots[t] < 0) continue;  // a padding token: nothing to store
        const int64_t row = h * num_slots + slots[t];
        write_row(ks.data + t * ks.row_stride + h * ks.head_stride, D, cache_type, kc, kscale, row);
        write_row(vs.data + t * vs.row_stride + h * vs.head_stride, D, cache_type, vc, vscale, row);
    }
}

constexpr int64_t kItemGrain = 64;  // (token, head) rows of K and V

void write_kv(uintptr_t k, int64_t k_row_stride, int64_t k_head_stride, uintptr_t v, int64_t v_row_stride,
              int64_t v_head_stride, int64_t T, int Hkv, int D, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scale,
              uintptr_t v_scale, int cache_type, int64_t num_slots, uintptr_t slot_mapping) {
    const int64_t* slots = ptr<const int64_t>(slot_mapping);
    check_kv_write(T, cache_type, num_slots, slots);
    const Source ks{ptr<const float>(k), k_row_stride, k_head_stride}, vs{ptr<const float>(v), v_row_stride, v_head_stride};
    parallel_for(T * Hkv, kItemGrain, [&](int64_t begin, int64_t end) {
        write_items(ks, vs, Hkv, D, ptr<void>(k_cache), ptr<void>(v_cache), ptr<float>(k_scale), ptr<float>(v_scale),
                    cache_type, num_slots, slots, begin, end);
    });
}

}  // namespace

void entry::write_kv(const float* k, int64_t k_row_stride, int64_t k_head_stride, const float* v, int64_t v_row_stride,
                     int64_t v_head_stride, int64_t T, int Hkv, int D, void* k_cache, void* v_cache, float* k_scale,
                     float* v_scale, int cache_type, int64_t num_slots, const int64_t* slot_mapping) {
    tmk::write_kv(uintptr_t(k), k_row_stride, k_head_stride, uintptr_t(v), v_row_stride, v_head_stride, T, Hkv, D,
                  uintptr_t(k_cache), uintptr_t(v_cache), uintptr_t(k_scale), uintptr_t(v_scale), cache_type, num_slots,
                  uintptr_t(slot_mapping));
}
void entry::check_kv_write(int64_t T, int cache_type, int64_t num_slots, const int64_t* slot_mapping) {
    tmk::check_kv_write(T, cache_type, num_slots, slot_mapping);
}
void entry::write_kv_tokens(const float* k, int64_t k_row_stride, int64_t k_head_stride, const float* v,
                            int64_t v_row_stride, int64_t v_head_stride, int Hkv, int D, void* k_cache, void* v_cache,
                            float* k_scale, float* v_scale, int cache_type, int64_t num_slots,
                            const int64_t* slot_mapping, int64_t b, int64_t e) {
    write_items({k, k_row_stride, k_head_stride}, {v, v_row_stride, v_head_stride}, Hkv, D, k_cache, v_cache, k_scale,
                v_scale, cache_type, num_slots, slot_mapping, b * Hkv, e * Hkv);
}
int64_t entry::kv_write_grain(int Hkv) { return std::max<int64_t>(1, kItemGrain / std::max(1, Hkv)); }
}  // namespace tmk

void register_kv_write(py::module_& m) {
    m.def("write_kv", &tmk::write_kv, py::call_guard<py::gil_scoped_release>(),
          "Store fp32 K/V rows [T, Hkv, D] into [Hkv, slots, D] caches at slot_mapping (raw addresses)",
          py::arg("k"), py::arg("k_row_stride"), py::arg("k_head_stride"), py::arg("v"), py::arg("v_row_stride"),
          py::arg("v_head_stride"), py::arg("T"), py::arg("Hkv"), py::arg("D"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("k_scale"), py::arg("v_scale"), py::arg("cache_type"), py::arg("num_slots"), py::arg("slot_mapping"));
}
