// W8A8 on AVX-512 VNNI (CPUs without AMX: AMD Zen 4 and 5, Intel Cascade Lake to Ice Lake): int8 weights
// (one scale per output row) times int8 activations quantized per token, as
// corerun.quantization.int8_matmul defines them, for a decode step's few tokens and a prefill's many.
//
// Ops (registered in the torch.ops.corerun_quant_cpu library with the other sources'; see kernels.py):
//   int8_vnni_linear(out, packed, w_corr, w_scale, x)
//     packed   int8_repack's layout (int8_amx.cpp): 16 rows at a time, their columns in fours; one 64-byte
//              vector holds 4 columns of 16 rows, the signed operand of one VPDPBUSD
//     w_corr   int32 [ceil(rows / 16) * 16]: -128 * sum_i W[j, i] (zeros past the last row)
//     w_scale  float32 [rows];  x float32 or bfloat16 [T, cols], contiguous;  out [T, rows] of x's dtype
//     out[t, j] = round(float(sum_i q[t, i] W[j, i]) * w_scale[j] * s_t), the same arithmetic as
//     int8_amx_linear's (w8a8_quantize.h's codes, the exact int32 sum, the scales in that order).
//   int8_vnni_available() -> whether this CPU has AVX-512 F/BW/VL/DQ and VNNI.
//
// VPDPBUSD multiplies unsigned by signed bytes, so the codes go in as q + 128 (1 .. 255) and each sum starts
// from the row's -128 sum(W[j, :]): sum (q + 128) W - 128 sum W = sum q W, exact in int32 for up to 65,536
// columns.  A tile is RB row blocks (RB * 16 rows) against NT tokens, RB * NT accumulators: for each 4
// columns, RB weight vectors are loaded once and each token's 4 codes broadcast once.  Groups of 4 row
// blocks are split over at::parallel_for (torch's thread pool and OpenMP runtime); within a group the tokens
// go NT at a time, the group's weights (64 rows x cols bytes, under 100 KiB for the default model) read from
// memory by the first tile and from L2 by the others.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "bf16_round.h"
#include "w8a8_quantize.h"

namespace {

#define INT8_VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

constexpr int GROUP = 4;   // row blocks of a tile (64 rows)
constexpr int TOKENS = 6;  // tokens of a tile: 4 x 6 accumulators, 4 weight vectors and a broadcast in 29 registers
constexpr int64_t PREFETCH = 1024;  // bytes ahead in each row block's stream, on a group's first tile

bool int8_vnni_available() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

struct Vnni {
    const int8_t* packed;
    const int32_t* corr;
    const float* ws;
    const uint8_t* xu;  // [T, cols] codes + 128
    const float* xs;    // [T]
    void* out;
    bool bf16_out;
    int64_t rows, cols, out_stride;
};

// RB row blocks from block b0 against tokens t0 .. t0 + NT: the sums, then scaled and stored.  The loops over
// rb and n are unrolled whole, so that the accumulators stay in registers (without the pragma GCC kept
// them on the stack, a load and a store around every VPDPBUSD).
template <int RB, int NT, bool Prefetch>
INT8_VNNI_FN void tile(const Vnni& a, int64_t b0, int64_t t0) {
    const int64_t stride = a.cols * 16;  // bytes of one row block
    const int8_t* w = a.packed + b0 * stride;
    const uint8_t* x = a.xu + t0 * a.cols;
    __m512i acc[RB][NT];
    _Pragma("GCC unroll 8") for (int rb = 0; rb < RB; ++rb) {
        const __m512i c = _mm512_loadu_si512(a.corr + (b0 + rb) * 16);
        _Pragma("GCC unroll 8") for (int n = 0; n < NT; ++n) acc[rb][n] = c;
    }
    for (int64_t i = 0; i < a.cols; i += 4) {
        __m512i wv[RB];
        _Pragma("GCC unroll 8") for (int rb = 0; rb < RB; ++rb) {
            const int8_t* p = w + rb * stride + i * 16;
            if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH), _MM_HINT_T0);
            wv[rb] = _mm512_loadu_si512(p);
        }
        _Pragma("GCC unroll 8") for (int n = 0; n < NT; ++n) {
            int32_t four;
            std::memcpy(&four, x + n * a.cols + i, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            _Pragma("GCC unroll 8") for (int rb = 0; rb < RB; ++rb) acc[rb][n] = _mm512_dpbusd_epi32(acc[rb][n], xb, wv[rb]);
        }
    }
    alignas(64) int32_t sums[RB][NT][16];  // the accumulators leave registers once, here
    _Pragma("GCC unroll 8") for (int rb = 0; rb < RB; ++rb) {
        _Pragma("GCC unroll 8") for (int n = 0; n < NT; ++n) _mm512_store_si512(sums[rb][n], acc[rb][n]);
    }
    for (int rb = 0; rb < RB; ++rb) {
        const int64_t j = (b0 + rb) * 16, valid = std::min<int64_t>(16, a.rows - j);
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
        const __m512 ws = _mm512_maskz_loadu_ps(mask, a.ws + j);
        for (int n = 0; n < NT; ++n) {
            const int64_t t = t0 + n;
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[rb][n])), ws), _mm512_set1_ps(a.xs[t]));
            if (a.bf16_out) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + t * a.out_stride + j, mask, corerun_bf16::round16(y));
            else _mm512_mask_storeu_ps(static_cast<float*>(a.out) + t * a.out_stride + j, mask, y);
        }
    }
}

template <int RB>
INT8_VNNI_FN void tokens(const Vnni& a, int64_t b0, int64_t T) {
    int64_t t0 = 0;
    if (T >= TOKENS) {  // the first tile streams the weights from memory: prefetched
        tile<RB, TOKENS, true>(a, b0, 0);
        for (t0 = TOKENS; t0 + TOKENS <= T; t0 += TOKENS) tile<RB, TOKENS, false>(a, b0, t0);
    }
    switch (T - t0) {
        case 1: tile<RB, 1, true>(a, b0, t0); break;
        case 2: tile<RB, 2, true>(a, b0, t0); break;
        case 3: tile<RB, 3, true>(a, b0, t0); break;
        case 4: tile<RB, 4, true>(a, b0, t0); break;
        case 5: tile<RB, 5, true>(a, b0, t0); break;
        default: break;
    }
}

void int8_vnni_linear(at::Tensor out, const at::Tensor& packed, const at::Tensor& w_corr, const at::Tensor& w_scale, const at::Tensor& x) {
    TORCH_CHECK(int8_vnni_available(), "int8_vnni_linear: this CPU lacks AVX-512 VNNI (with F, BW, VL, DQ)");
    corerun_w8a8::check_linear("int8_vnni_linear", out, packed, w_scale, x);
    const int64_t T = x.size(0), cols = x.size(1), rows = out.size(1), blocks = (rows + 15) / 16;
    TORCH_CHECK(w_corr.device().is_cpu() && w_corr.scalar_type() == at::kInt && w_corr.is_contiguous() && w_corr.numel() == blocks * 16,
                "int8_vnni_linear: w_corr must be contiguous int32 with ", blocks * 16, " values (-128 times each row's sum, zeros past row ",
                rows, "), got ", w_corr.scalar_type(), " ", w_corr.sizes());
    if (T == 0 || rows == 0) return;
    const corerun_w8a8::Codes q = corerun_w8a8::quantize_tokens<true>(x, T);
    const Vnni a{packed.data_ptr<int8_t>(), w_corr.data_ptr<int32_t>(), w_scale.data_ptr<float>(), reinterpret_cast<const uint8_t*>(q.codes),
                 q.scales, out.data_ptr(), x.scalar_type() == at::kBFloat16, rows, cols, out.stride(0)};
    const int64_t groups = (blocks + GROUP - 1) / GROUP;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
            const int64_t b0 = g * GROUP;
            if (b0 + GROUP <= blocks) tokens<GROUP>(a, b0, T);
            else
                for (int64_t b = b0; b < blocks; ++b) tokens<1>(a, b, T);
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corerun_quant_cpu, m) {
    m.def("int8_vnni_linear(Tensor(a!) out, Tensor packed, Tensor w_corr, Tensor w_scale, Tensor x) -> ()");
    m.def("int8_vnni_available() -> bool", int8_vnni_available);
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) { m.impl("int8_vnni_linear", int8_vnni_linear); }
