// What AMX-BF16 products would give prompt rows (a probe, not a kernel; nothing imports it). C[M,N] =
// A[M,K] B[N,K]^T with fp32 accumulation over all of K, so no per-block scaling: one TDPBF16PS per
// 16x16x32 step on bf16-rounded operands ("bf16x1": bench/prompt_bf16_quality.py measured it at 88.9%
// greedy tokens identical to fp32 for SmolLM2, against the GGUF kernels' 100%), or three on operands
// split into two bf16 planes each, hi.hi + hi.lo + lo.hi ("bf16x3": 100%, prefill logits 0.018 from
// fp32 against the GGUF kernels' 0.024; `prompt_bf16_quality.py --bf16x3`).
//
//     g++ -O2 -march=sapphirerapids -o /tmp/amx_bf16_probe bench/amx_bf16_probe.cpp && /tmp/amx_bf16_probe 512 3072 576 1
//
// SmolLM2's gate_up at 512 rows, 1 thread, 2-core Sapphire Rapids VM (2026-11-27, alternated in the same
// minutes): this probe's bf16x3 8.1-8.3 ms and bf16x1 4.4 ms; oneDNN's bf16 matmul (one product, blocked
// far better than this probe) 2.0 ms; the GGUF AMX-INT8 kernel (two int8 products and the per-block
// scaling) 6.2 ms. Three products at oneDNN's efficiency would be ~6 ms: no faster than the int8
// kernel, so prompt rows stay on it; one product is fast but costs the accuracy above.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>

struct Cfg { uint8_t palette = 1, start = 0; uint8_t res[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static float fb(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; memcpy(&f, &u, 4); return f; }

int main(int argc, char** argv) {
    const int M = argc > 1 ? atoi(argv[1]) : 512, N = argc > 2 ? atoi(argv[2]) : 3072, K = argc > 3 ? atoi(argv[3]) : 576;
    const int three = argc > 4 ? atoi(argv[4]) : 1;
    if (M % 16 || N % 32 || K % 32) { puts("M must be a multiple of 16, N of 32, K of 32"); return 1; }
    if (syscall(SYS_arch_prctl, 0x1023, 18))  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        { puts("no AMX permission"); return 1; }
    std::vector<float> x(size_t(M) * K), w(size_t(N) * K);
    for (auto& v : x) v = float(rand()) / RAND_MAX - 0.5f;
    for (auto& v : w) v = (float(rand()) / RAND_MAX - 0.5f) * 0.1f;
    // A planes [M][K] bf16; B planes in tile layout: [tile][kstep][16 pairs][16 cols][2]
    std::vector<uint16_t> ah(size_t(M) * K), al(size_t(M) * K);
    for (size_t i = 0; i < x.size(); ++i) { ah[i] = bf(x[i]); al[i] = bf(x[i] - fb(ah[i])); }
    const int T = N / 16, S = K / 32;
    std::vector<uint16_t> bh(size_t(N) * K), bl(size_t(N) * K);
    for (int t = 0; t < T; ++t) for (int s = 0; s < S; ++s) for (int p = 0; p < 16; ++p) for (int c = 0; c < 16; ++c) for (int e = 0; e < 2; ++e) {
        const float v = w[size_t(t * 16 + c) * K + s * 32 + 2 * p + e];
        const size_t o = ((size_t(t) * S + s) * 16 + p) * 32 + c * 2 + e;
        bh[o] = bf(v); bl[o] = bf(v - fb(bh[o]));
    }
    std::vector<float> out(size_t(M) * N);
    Cfg cfg;
    for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    asm volatile("ldtilecfg %0" : : "m"(cfg));
    auto run = [&]() {
        for (int tc = 0; tc < T; tc += 8)
            for (int m = 0; m < M; m += 16)
                for (int t = tc; t < tc + 8 && t < T; t += 2) {
                    _tile_zero(6); _tile_zero(7);
                    const uint16_t* a0 = &ah[size_t(m) * K];
                    const uint16_t* a1 = &al[size_t(m) * K];
                    for (int s = 0; s < S; ++s) {
                        _tile_loadd(0, a0 + s * 32, K * 2);
                        _tile_loadd(2, &bh[(size_t(t) * S + s) * 512], 64);
                        _tile_loadd(4, &bh[(size_t(t + 1) * S + s) * 512], 64);
                        _tile_dpbf16ps(6, 0, 2);
                        _tile_dpbf16ps(7, 0, 4);
                        if (three) {
                            _tile_loadd(1, a1 + s * 32, K * 2);
                            _tile_loadd(3, &bl[(size_t(t) * S + s) * 512], 64);
                            _tile_loadd(5, &bl[(size_t(t + 1) * S + s) * 512], 64);
                            _tile_dpbf16ps(6, 0, 3);
                            _tile_dpbf16ps(7, 0, 5);
                            _tile_dpbf16ps(6, 1, 2);
                            _tile_dpbf16ps(7, 1, 4);
                        }
                    }
                    _tile_stored(6, &out[size_t(m) * N + t * 16], N * 4);
                    _tile_stored(7, &out[size_t(m) * N + (t + 1) * 16], N * 4);
                }
    };
    run();
    double best = 1e9;
    for (int r = 0; r < 20; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        run();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    double err = 0, ref_max = 0;
    for (int m = 0; m < M; m += 37) for (int n = 0; n < N; n += 53) {
        double r = 0; for (int k = 0; k < K; ++k) r += double(x[size_t(m) * K + k]) * w[size_t(n) * K + k];
        err = std::max(err, std::fabs(r - out[size_t(m) * N + n])); ref_max = std::max(ref_max, std::fabs(r));
    }
    printf("M=%d N=%d K=%d %s: %.0f us/call, 1 thread (%.0f GMAC/s); max |err| %.2e of max %.2f\n", M, N, K,
           three ? "bf16x3" : "bf16x1", best * 1e6, double(M) * N * K / best / 1e9, err, ref_max);
    _tile_release();
}
