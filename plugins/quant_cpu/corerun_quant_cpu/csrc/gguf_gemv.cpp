// GGUF block formats times float32 activations on CPU, read straight from the packed blocks.
//
// Op (registered as torch.ops.corerun_quant_cpu.gguf_gemv; see kernels.py):
//   gguf_gemv(out, blocks, x, type, isa)
//     blocks  uint8 [rows, cols / 32 * block_bytes], one GGML row per output feature, contiguous
//     x       float32 [T, cols], contiguous
//     out     float32 [T, rows], last dimension contiguous (a column slice of a wider output is fine)
//     type    0 = Q8_0 (34-byte blocks), 1 = Q4_0 (18), 2 = Q4_1 (20); 32 values per block
//     isa     0 = scalar, 1 = AVX2 + FMA + F16C, 2 = AVX-512 (F, BW, VL, DQ, VBMI) + VNNI with int8
//             activations (refused where the CPU lacks them)
//   gguf_dequantize(out, blocks, type, isa)
//     out     float32 [rows, cols] contiguous: the decoded weight (for calls too large for gguf_gemv)
//   gguf_gemv_q8(out, blocks, x, type)   AVX2 only; for comparison (benchmarks/gguf_kernel_bench.py),
//     not used by the method: llama.cpp's way, x quantized per 32-block to int8 (scale max|x_b| / 127)
//     once per call, integer dot products per block, scales applied at the end.  Adds half an
//     activation step per block to the error bound.
//   gguf_q8_0_repack(codes, scales, blocks)   Q8_0 blocks [rows, nb * 34] -> codes uint8 [rows, nb * 32]
//     and scales float16 [rows, nb] (the blocks' d), the layout gguf_gemv_q8_0r reads (see its section); once, at load
//   gguf_gemv_q8_0r(out, codes, scales, x)   AVX-512 + VNNI only: gguf_gemv of repacked Q8_0 rows,
//     int8 activations as in gguf_gemv's AVX-512 path (the method's Q8_0 product there)
//   w4_gemv(out, codes, scales, negzs, x, gb)   AVX-512 + VNNI only: 4-bit codes with float32 scales and
//     zero terms per granule of gb 32-blocks (GPTQ, AWQ, compressed-tensors W4A16 repacked at load; see its
//     section), int8 activations as in gguf_gemv's AVX-512 path
//   w4_dequantize(out, codes, scales, negzs, gb, isa)   those weights decoded into float32 [rows, cols] (prefill;
//     isa 2: AVX-512 F, else a scalar loop)
//   gguf_isa() -> the best isa this CPU runs.
//
// Method (scalar, AVX2): dequantize in registers, never in memory.  For a block b of row j with scale d (and
// minimum m for Q4_1) and codes q, the block's share of y[t, j] is
//   Q8_0: d * sum(q * x)        Q4_0: d * (sum(q * x) - 8 * sum(x))        Q4_1: d * sum(q * x) + m * sum(x)
// where sum(x) over the block is computed once per call for every token.  Codes become float32
// exactly; sums are float32 with fused multiply-adds.  Work is split over output rows with
// at::parallel_for (torch's own thread pool and OpenMP runtime); tokens go in tiles of 4 so that a
// row's blocks are read from memory once and from L1 for the other tiles.  The AVX-512 path quantizes
// x to int8 instead (see its section): integer dot products, at most half an activation step per
// value of error on top of the float32 rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>

#include "cpu_features.h"

namespace {

enum Type : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t QK = 32;
constexpr int64_t TILE = 4;  // tokens per pass over a row

int64_t block_bytes(int64_t type) { return type == Q8_0 ? 34 : type == Q4_0 ? 18 : 20; }

float half_to_float(uint16_t h) {  // IEEE binary16 -> float32, exact (subnormals, inf and NaN included)
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
            u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

struct Problem {
    const uint8_t* blocks;
    const float* x;
    const float* xsum;  // [T, nb] sums of x over each block
    float* out;
    int64_t T, cols, nb, row_bytes, out_stride, type;
};

// ---- scalar ---------------------------------------------------------------------------------------

void rows_scalar(const Problem& p, int64_t begin, int64_t end) {
    const int64_t bb = block_bytes(p.type);
    for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = p.blocks + j * p.row_bytes;
        for (int64_t t = 0; t < p.T; ++t) {
            const float* xt = p.x + t * p.cols;
            float acc = 0.f;
            for (int64_t b = 0; b < p.nb; ++b) {
                const uint8_t* blk = row + b * bb;
                const float* xb = xt + b * QK;
                const float d = half_to_float(load_u16(blk));
                float s = 0.f;
                if (p.type == Q8_0) {
                    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
                    for (int i = 0; i < QK; ++i) s += static_cast<float>(q[i]) * xb[i];
                    acc += d * s;
                } else {
                    const uint8_t* q = blk + (p.type == Q4_1 ? 4 : 2);
                    for (int i = 0; i < QK / 2; ++i) {
                        s += static_cast<float>(q[i] & 0x0f) * xb[i];
                        s += static_cast<float>(q[i] >> 4) * xb[i + QK / 2];
                    }
                    const float sx = p.xsum[t * p.nb + b];
                    if (p.type == Q4_0) acc += d * (s - 8.f * sx);
                    else acc += d * s + half_to_float(load_u16(blk + 2)) * sx;
                }
            }
            p.out[t * p.out_stride + j] = acc;
        }
    }
}

void dequant_scalar(const uint8_t* blocks, float* w, int64_t type, int64_t nb, int64_t row_bytes, int64_t begin, int64_t end) {
    const int64_t bb = block_bytes(type);
    for (int64_t j = begin; j < end; ++j) {
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = blocks + j * row_bytes + b * bb;
            float* o = w + (j * nb + b) * QK;
            const float d = half_to_float(load_u16(blk));
            if (type == Q8_0) {
                const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
                for (int i = 0; i < QK; ++i) o[i] = d * static_cast<float>(q[i]);
                continue;
            }
            const uint8_t* q = blk + (type == Q4_1 ? 4 : 2);
            const float m = type == Q4_1 ? half_to_float(load_u16(blk + 2)) : 0.f;
            const int off = type == Q4_0 ? 8 : 0;
            for (int i = 0; i < QK / 2; ++i) {
                o[i] = d * static_cast<float>((q[i] & 0x0f) - off) + m;
                o[i + QK / 2] = d * static_cast<float>((q[i] >> 4) - off) + m;
            }
        }
    }
}

// ---- AVX2 + FMA -----------------------------------------------------------------------------------

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// the 32 codes of a block as four vectors of 8 floats, in value order
AVX2_FN inline void codes_q4(const uint8_t* q, __m256 w[4]) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

AVX2_FN inline void codes_q8(const uint8_t* q, __m256 w[4]) {
    for (int k = 0; k < 4; ++k) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k));
        w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
}

template <int64_t TYPE, int NT>
AVX2_FN void row_tile_avx2(const Problem& p, const uint8_t* row, int64_t t0, int64_t j) {
    constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20;
    __m256 acc[NT];
    float corr[NT];  // Q4_0's -8 d sum(x), Q4_1's m sum(x): one scalar per block and token
    for (int n = 0; n < NT; ++n) {
        acc[n] = _mm256_setzero_ps();
        corr[n] = 0.f;
    }
    for (int64_t b = 0; b < p.nb; ++b) {
        const uint8_t* blk = row + b * bb;
        __m256 w[4];
        if (TYPE == Q8_0) codes_q8(blk + 2, w);
        else codes_q4(blk + (TYPE == Q4_1 ? 4 : 2), w);
        const float d = _cvtsh_ss(load_u16(blk));
        const __m256 dv = _mm256_set1_ps(d);
        float c = 0.f;
        if (TYPE == Q4_0) c = -8.f * d;
        if (TYPE == Q4_1) c = _cvtsh_ss(load_u16(blk + 2));
        for (int n = 0; n < NT; ++n) {
            const float* xb = p.x + (t0 + n) * p.cols + b * QK;
            __m256 s0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
            __m256 s1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8));
            s0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), s0);
            s1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), s1);
            acc[n] = _mm256_fmadd_ps(dv, _mm256_add_ps(s0, s1), acc[n]);
            if (TYPE != Q8_0) corr[n] += c * p.xsum[(t0 + n) * p.nb + b];
        }
    }
    for (int n = 0; n < NT; ++n) p.out[(t0 + n) * p.out_stride + j] = hsum8(acc[n]) + corr[n];
}

template <int64_t TYPE>
AVX2_FN void rows_avx2_typed(const Problem& p, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = p.blocks + j * p.row_bytes;
        int64_t t = 0;
        for (; t + TILE <= p.T; t += TILE) row_tile_avx2<TYPE, TILE>(p, row, t, j);
        for (; t < p.T; ++t) row_tile_avx2<TYPE, 1>(p, row, t, j);
    }
}

void rows_avx2(const Problem& p, int64_t begin, int64_t end) {
    if (p.type == Q8_0) rows_avx2_typed<Q8_0>(p, begin, end);
    else if (p.type == Q4_0) rows_avx2_typed<Q4_0>(p, begin, end);
    else rows_avx2_typed<Q4_1>(p, begin, end);
}

template <int64_t TYPE>
AVX2_FN void dequant_avx2_typed(const uint8_t* blocks, float* w, int64_t nb, int64_t row_bytes, int64_t begin, int64_t end) {
    constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20;
    for (int64_t j = begin; j < end; ++j) {
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = blocks + j * row_bytes + b * bb;
            float* o = w + (j * nb + b) * QK;
            __m256 v[4];
            if (TYPE == Q8_0) codes_q8(blk + 2, v);
            else codes_q4(blk + (TYPE == Q4_1 ? 4 : 2), v);
            const float d = _cvtsh_ss(load_u16(blk));
            const __m256 dv = _mm256_set1_ps(d);
            const __m256 cv = _mm256_set1_ps(TYPE == Q4_1 ? _cvtsh_ss(load_u16(blk + 2)) : TYPE == Q4_0 ? -8.f * d : 0.f);
            for (int k = 0; k < 4; ++k) _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(v[k], dv, cv));
        }
    }
}

void dequant_avx2(const uint8_t* blocks, float* w, int64_t type, int64_t nb, int64_t row_bytes, int64_t begin, int64_t end) {
    if (type == Q8_0) dequant_avx2_typed<Q8_0>(blocks, w, nb, row_bytes, begin, end);
    else if (type == Q4_0) dequant_avx2_typed<Q4_0>(blocks, w, nb, row_bytes, begin, end);
    else dequant_avx2_typed<Q4_1>(blocks, w, nb, row_bytes, begin, end);
}

// ---- llama.cpp's way, for comparison: int8 activations, integer block dot products ------------------

struct XQuant {  // per token and block: int8 codes, their scale and the sum of the codes
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> sum;
};

XQuant quantize_x(const float* x, int64_t T, int64_t cols) {
    const int64_t nb = cols / QK;
    XQuant r{std::vector<int8_t>(static_cast<size_t>(T * cols)), std::vector<float>(static_cast<size_t>(T * nb)),
             std::vector<int32_t>(static_cast<size_t>(T * nb))};
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            float amax = 0.f;
            for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int32_t sum = 0;
            for (int i = 0; i < QK; ++i) {
                const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
                r.q[t * cols + b * QK + i] = static_cast<int8_t>(v);
                sum += v;
            }
            r.d[t * nb + b] = d;
            r.sum[t * nb + b] = sum;
        }
    return r;
}

template <int64_t TYPE>
AVX2_FN void rows_q8act_avx2(const uint8_t* blocks, const XQuant& xq, float* out, int64_t T, int64_t cols,
                             int64_t out_stride, int64_t begin, int64_t end) {
    constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20;
    const int64_t nb = cols / QK, row_bytes = nb * bb;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t j = begin; j < end; ++j) {
        for (int64_t t = 0; t < T; ++t) {
            __m256 acc = _mm256_setzero_ps();
            float corr = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = blocks + j * row_bytes + b * bb;
                const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + t * cols + b * QK));
                const float dw = _cvtsh_ss(load_u16(blk)), dx = xq.d[t * nb + b];
                __m256i p16;
                if (TYPE == Q8_0) {
                    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
                    p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
                } else {
                    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == Q4_1 ? 4 : 2)));
                    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
                    p16 = _mm256_maddubs_epi16(w, xv);
                    const float s = static_cast<float>(xq.sum[t * nb + b]) * dx;
                    corr += TYPE == Q4_1 ? _cvtsh_ss(load_u16(blk + 2)) * s : -8.f * dw * s;
                }
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), f, acc);
            }
            out[t * out_stride + j] = hsum8(acc) + corr;
        }
    }
}

// ---- AVX-512 + VNNI: int8 activations, vpdpbusd --------------------------------------------------
//
// llama.cpp's approach.  x is quantized once per call, per token and 32-block: dx = max|x_b| / 127,
// qx = round(x / dx) in [-127, 127] (|x - dx qx| <= dx / 2), sx = dx * sum(qx).  The integer dot of
// a block's codes with qx is exact (vpdpbusd: unsigned bytes times signed bytes, four at a time into
// int32), then scaled:   Q8_0: dw dx dot     Q4_0: dw (dx dot - 8 sx)     Q4_1: dw dx dot + m sx.
// Blocks go in groups of four: Q4's 4 x 16 bytes of nibbles are one 64-byte vector (low nibbles:
// values 0-15 of each block, high: 16-31), so qx is stored per group as the 16 first values of each
// block, then the 16 last; Q8_0's four blocks are two 64-byte vectors, qx in natural order.  The
// per-block scales are spread over the int32 lanes that hold that block's partial sums (4 lanes a
// block for Q4, 8 for Q8_0): a group's scales and Q4 codes come out of one or two 64-byte loads by
// byte and word permutes (AVX512_VBMI's vpermt2b), with no horizontal sum until the row ends.  The last nb % 4 blocks
// go one at a time in 256-bit vectors.

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")))

struct XQ {  // one call's quantized activations, per token
    std::vector<int8_t> q;    // [T, cols]: codes, in the kernel's order (see above)
    std::vector<float> dxe;   // [T, groups * 16 * V]: dx of the block each lane sums (V vectors a group)
    std::vector<float> sxe;   // [T, groups * 16]: Q4_0: -2 sx, Q4_1: sx / 4 (a block's 4 lanes sum to -8 sx, sx)
    std::vector<float> dx, sx;  // [T, nb], for the blocks after the last whole group
};

AVX512_FN void quantize_x_avx512(const float* x, int64_t T, int64_t cols, int64_t type, XQ& r) {
    const int64_t nb = cols / QK, groups = nb / 4, V = type == Q8_0 ? 2 : 1;
    r.q.resize(static_cast<size_t>(T * cols));
    r.dxe.resize(static_cast<size_t>(T * groups * 16 * V));
    r.sxe.resize(static_cast<size_t>(T * groups * 16));
    r.dx.resize(static_cast<size_t>(T * nb));
    r.sx.resize(static_cast<size_t>(T * nb));
    for (int64_t t = 0; t < T; ++t) {
        int8_t* qt = r.q.data() + t * cols;
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // nearest, ties to even
            const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            const __m128i c0 = _mm512_cvtsepi32_epi8(i0), c1 = _mm512_cvtsepi32_epi8(i1);
            const int64_t g = b / 4, k = b % 4;
            if (type != Q8_0 && g < groups) {  // group layout: first halves of the 4 blocks, then the second halves
                _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + g * 128 + k * 16), c0);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + g * 128 + 64 + k * 16), c1);
            } else {
                _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * QK), c0);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * QK + 16), c1);
            }
            const float s = d * static_cast<float>(sum);
            r.dx[t * nb + b] = d;
            r.sx[t * nb + b] = s;
            if (g < groups) {
                const int64_t lanes = 4 * V;  // lanes per block
                float* de = r.dxe.data() + (t * groups + g) * 16 * V + k * lanes;
                for (int64_t l = 0; l < lanes; ++l) de[l] = d;
                float* se = r.sxe.data() + (t * groups + g) * 16 + k * 4;
                for (int l = 0; l < 4; ++l) se[l] = type == Q4_0 ? -2.f * s : 0.25f * s;
            }
        }
    }
}

AVX512_FN inline float hsum8_512(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Byte and word permutes that take a group of four blocks apart from one or two 64-byte loads
// (vpermt2b, vpermw: no gathers, no inserts): nib[p] is the byte holding the codes of the p-th
// 16-byte lane (block p / 16); words[l] the f16 word each float lane's scale comes from (Q4: lanes
// 0-15 d, 16-31 m; Q8_0: 8 lanes a block).
struct Idx512 {
    alignas(64) uint8_t nib[64];
    alignas(64) uint16_t words[32];
};

template <int64_t TYPE>
const Idx512& idx512() {
    static const Idx512 r = [] {
        constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20, qo = TYPE == Q4_1 ? 4 : 2;
        Idx512 v{};
        for (int k = 0; k < 4; ++k)
            for (int i = 0; i < 16; ++i) v.nib[k * 16 + i] = static_cast<uint8_t>(k * bb + qo + i);
        for (int l = 0; l < 32; ++l) {
            const int64_t block = TYPE == Q8_0 ? l / 8 : (l % 16) / 4, extra = TYPE == Q4_1 && l >= 16 ? 1 : 0;
            v.words[l] = static_cast<uint16_t>(block * bb / 2 + extra);
        }
        return v;
    }();
    return r;
}

template <int64_t TYPE, int NT>
AVX512_FN void row_tile_avx512(const uint8_t* row, const XQ& xq, float* out, int64_t out_stride, int64_t cols,
                               int64_t t0, int64_t j) {
    constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20;
    constexpr int64_t V = TYPE == Q8_0 ? 2 : 1;
    const int64_t nb = cols / QK, groups = nb / 4;
    const Idx512& idx = idx512<TYPE>();
    const __m512i nib_idx = _mm512_load_si512(idx.nib), word_idx = _mm512_load_si512(idx.words);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __mmask64 past64 = TYPE == Q8_0 ? 0 : (1ull << ((4 * bb - 64) & 63)) - 1;  // Q4: the group's bytes after the first 64
    __m512 acc[NT];
    for (int n = 0; n < NT; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* blk = row + g * 4 * bb;
        const __m512i head = _mm512_loadu_si512(blk);
        if (TYPE == Q8_0) {
            const __m512i w16 = _mm512_permutex2var_epi16(head, word_idx, _mm512_loadu_si512(blk + 64));  // inside the group's 136 bytes
            const __m512 da = _mm512_cvtph_ps(_mm512_castsi512_si256(w16)), db = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w16, 1));
            const __m512i wa = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
                                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + bb + 2)), 1);
            const __m512i wb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * bb + 2))),
                                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 3 * bb + 2)), 1);
            // signed times signed through vpdpbusd: |w| (unsigned) times x carrying w's sign
            const __mmask64 na = _mm512_movepi8_mask(wa), nbm = _mm512_movepi8_mask(wb);
            const __m512i aa = _mm512_abs_epi8(wa), ab = _mm512_abs_epi8(wb);
            for (int n = 0; n < NT; ++n) {
                const int8_t* xg = xq.q.data() + (t0 + n) * cols + g * 128;
                const __m512i xa = _mm512_loadu_si512(xg), xb = _mm512_loadu_si512(xg + 64);
                const __m512i pa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aa, _mm512_mask_sub_epi8(xa, na, _mm512_setzero_si512(), xa));
                const __m512i pb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ab, _mm512_mask_sub_epi8(xb, nbm, _mm512_setzero_si512(), xb));
                const float* de = xq.dxe.data() + ((t0 + n) * groups + g) * 32;
                acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(da, _mm512_loadu_ps(de)), _mm512_cvtepi32_ps(pa), acc[n]);
                acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(db, _mm512_loadu_ps(de + 16)), _mm512_cvtepi32_ps(pb), acc[n]);
            }
        } else {
            // masked: never reads past the group (the row's last group may end its buffer)
            const __m512i raw = _mm512_permutex2var_epi8(head, nib_idx, _mm512_maskz_loadu_epi8(past64, blk + 64));
            const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            const __m512i w16 = _mm512_permutexvar_epi16(word_idx, head);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(w16));
            const __m512 c = TYPE == Q4_1 ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w16, 1)) : d;  // times sxe: m sx, or -8 d sx
            for (int n = 0; n < NT; ++n) {
                const int8_t* xg = xq.q.data() + (t0 + n) * cols + g * 128;
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xg));
                p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(xg + 64));
                const float* de = xq.dxe.data() + ((t0 + n) * groups + g) * 16;
                const float* se = xq.sxe.data() + ((t0 + n) * groups + g) * 16;
                acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_loadu_ps(de)), _mm512_cvtepi32_ps(p), acc[n]);
                acc[n] = _mm512_fmadd_ps(c, _mm512_loadu_ps(se), acc[n]);
            }
        }
    }
    float tail[NT];
    for (int n = 0; n < NT; ++n) tail[n] = 0.f;
    for (int64_t b = groups * 4; b < nb; ++b) {  // the blocks after the last whole group, one at a time
        const uint8_t* blk = row + b * bb;
        const float dw = _cvtsh_ss(load_u16(blk));
        __m256i w;
        if (TYPE == Q8_0) {
            w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        } else {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == Q4_1 ? 4 : 2)));
            const __m128i m4 = _mm_set1_epi8(0x0f);
            w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        }
        for (int n = 0; n < NT; ++n) {
            const int64_t t = t0 + n;
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + t * cols + b * QK));
            const __m256i p = TYPE == Q8_0 ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                           : _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
            const float dot = hsum8_512(_mm256_cvtepi32_ps(p)), dx = xq.dx[t * nb + b], sx = xq.sx[t * nb + b];
            if (TYPE == Q8_0) tail[n] += dw * dx * dot;
            else if (TYPE == Q4_0) tail[n] += dw * (dx * dot - 8.f * sx);
            else tail[n] += dw * dx * dot + _cvtsh_ss(load_u16(blk + 2)) * sx;
        }
    }
    for (int n = 0; n < NT; ++n) out[(t0 + n) * out_stride + j] = _mm512_reduce_add_ps(acc[n]) + tail[n];
}

template <int64_t TYPE>
AVX512_FN void rows_avx512_typed(const uint8_t* blocks, const XQ& xq, float* out, int64_t T, int64_t cols,
                                 int64_t out_stride, int64_t begin, int64_t end) {
    constexpr int64_t bb = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 20;
    const int64_t row_bytes = cols / QK * bb;
    for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = blocks + j * row_bytes;
        int64_t t = 0;
        for (; t + TILE <= T; t += TILE) row_tile_avx512<TYPE, TILE>(row, xq, out, out_stride, cols, t, j);
        for (; t < T; ++t) row_tile_avx512<TYPE, 1>(row, xq, out, out_stride, cols, t, j);
    }
}

void rows_avx512(const uint8_t* blocks, const XQ& xq, float* out, int64_t type, int64_t T, int64_t cols,
                 int64_t out_stride, int64_t begin, int64_t end) {
    if (type == Q8_0) rows_avx512_typed<Q8_0>(blocks, xq, out, T, cols, out_stride, begin, end);
    else if (type == Q4_0) rows_avx512_typed<Q4_0>(blocks, xq, out, T, cols, out_stride, begin, end);
    else rows_avx512_typed<Q4_1>(blocks, xq, out, T, cols, out_stride, begin, end);
}

// ---- AVX-512 + VNNI on Q8_0 repacked at load --------------------------------------------------------
//
// gguf_q8_0_repack turns a Q8_0 row (34-byte blocks: f16 d, 32 int8 codes) into its codes, offset to
// unsigned (w + 128, exact for every int8) and moved so that one int32 lane of vpdpbusd sums one block
// only, in a buffer of their own ([rows, cols] uint8: 64-byte loads, no permutes), and its scales as
// they were (float16 [rows, nb]: as many bytes as the blocks).  A row's blocks go in spans of G = 16,
// 8, 4, 2 or 1 blocks (16 while 16 are left, then the binary digits of the rest: 18 = 16 + 2); a span
// of G >= 2 is G / 2 vectors of 64 bytes whose lane l (4 bytes) holds block l % G, so the span's int32
// dot products build up lane by lane with no shuffle and are scaled once, its scales one load,
// converted and repeated (G = 16: 16 in a row, 8: twice, 4: four times, 2: eight times).  In vector k
// of a span, lane l, byte i is the block's code  4 (l / G + 16 / G * k) + i;  G = 1 is one block in a
// 256-bit vector, codes in order.  Rows go in fours, their vectors interleaved in the order the
// product reads them (span by span, vector k of rows 4q, 4q + 1, 4q + 2, 4q + 3, then k + 1): one
// sequential stream; the last rows % 4 rows follow one after the other.
// x is quantized as for the other AVX-512 path (dx = max|x_b| / 127) and its codes put in that same
// order; vpdpbusd of (w + 128) with qx adds 128 sum(qx) over the lane's bytes, so each lane starts
// from minus that sum (once per call and token).  Integer sums stay below 2^24: exact in float32.

// One token takes a group's four rows through q8r_one_token, with no software prefetch: a model's
// step reads its weights from memory (the default model's 120 Q8_0 products: 113 MB of codes), and
// there a prefetch 2048 bytes ahead made the step's products 1.43x slower on one thread (9.14 against
// 6.38 ms) and 1.37x on two; it helped only with the weights in the L3 cache.  Splitting a thread's
// groups into 2, 3 or 4 streams read side by side (as the bfloat16 product does) was no faster here
// (benchmarks/RESULTS.md, "Twenty-first session").

struct Span {
    int64_t b0, g;  // first block, blocks
};

std::vector<Span> q8r_spans(int64_t nb) {
    std::vector<Span> s;
    int64_t b = 0;
    for (; nb - b >= 16; b += 16) s.push_back({b, 16});
    for (int64_t g = 8; g >= 1; g /= 2)
        if ((nb - b) & g) {
            s.push_back({b, g});
            b += g;
        }
    return s;
}

// where the 4 codes u (0-7) of block m of a span of g blocks go, as a byte offset in the span
inline int64_t q8r_unit(int64_t g, int64_t m, int64_t u) { return u / (16 / g) * 64 + (u % (16 / g) * g + m) * 4; }

struct XR {  // one call's activations for the repacked product, per token
    std::vector<int8_t> q;      // [T, cols] codes, in the weights' order
    std::vector<int32_t> corr;  // [T, spans * 16]: -128 times the sum of the codes each lane multiplies
    std::vector<float> dxl;     // [T, spans * 16]: dx of the block each lane sums
};

AVX512_FN void quantize_x_q8r(const float* x, int64_t T, int64_t cols, const std::vector<Span>& spans, XR& r) {
    const int64_t ns = static_cast<int64_t>(spans.size()) * 16;
    r.q.resize(static_cast<size_t>(T * cols));
    r.corr.assign(static_cast<size_t>(T * ns), 0);
    r.dxl.resize(static_cast<size_t>(T * ns));
    alignas(64) int8_t codes[32];
    float dx[16];
    for (int64_t t = 0; t < T; ++t) {
        int8_t* qt = r.q.data() + t * cols;
        for (size_t s = 0; s < spans.size(); ++s) {
            const int64_t b0 = spans[s].b0, g = spans[s].g;
            int32_t* corr = r.corr.data() + t * ns + static_cast<int64_t>(s) * 16;
            for (int64_t m = 0; m < g; ++m) {
                const float* xb = x + t * cols + (b0 + m) * QK;
                const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
                const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                const float inv = amax > 0.f ? 127.f / amax : 0.f;
                dx[m] = amax / 127.f;
                _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)))));
                _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)))));
                for (int64_t u = 0; u < 8; ++u) {
                    const int64_t at = q8r_unit(g, m, u);
                    std::memcpy(qt + b0 * QK + at, codes + 4 * u, 4);
                    corr[(at % 64) / 4] -= 128 * (codes[4 * u] + codes[4 * u + 1] + codes[4 * u + 2] + codes[4 * u + 3]);
                }
            }
            float* dl = r.dxl.data() + t * ns + static_cast<int64_t>(s) * 16;
            for (int64_t l = 0; l < 16; ++l) dl[l] = dx[l % g];
        }
    }
}

struct Q8R {
    const uint8_t* codes;  // see chunk()
    const uint16_t* scales;  // float16
    const XR& xr;
    const std::vector<Span>& spans;
    float* out;
    int64_t cols, nb, ns, out_stride;
};

template <int G>
AVX512_FN __attribute__((always_inline)) inline __m512 q8r_scales(const uint16_t* s) {
    if constexpr (G == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    if constexpr (G == 8) return _mm512_broadcast_f32x8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    if constexpr (G == 4) return _mm512_broadcast_f32x4(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
    int32_t two;
    std::memcpy(&two, s, 4);
    return _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(_mm_cvtph_ps(_mm_cvtsi32_si128(two)))));
}

// the codes of row r0 + r of a group of rg rows at gbase (rows 4q...: 4; the last rows % 4: 1 each),
// vector k of the span that starts at byte off of a row; cb: the span's vector bytes (64; G = 1: 32)
inline const uint8_t* chunk(const uint8_t* gbase, int64_t rg, int64_t r, int64_t off, int64_t k, int64_t cb) {
    return gbase + rg * off + (k * rg + r) * cb;
}

// one span of R rows (j... = group row r0...) times N tokens (t0...), added to acc
template <int G, int R, int N>
AVX512_FN __attribute__((always_inline)) inline void q8r_span(const Q8R& p, int64_t s, int64_t b0, const uint8_t* gbase, int64_t rg, int64_t r0,
                                                              int64_t j, int64_t t0, __m512 (&acc)[R][N]) {
    const int64_t off = b0 * QK;
    const int8_t* xq = p.xr.q.data() + t0 * p.cols + off;
    const int32_t* corr = p.xr.corr.data() + t0 * p.ns + s * 16;
    const float* dxl = p.xr.dxl.data() + t0 * p.ns + s * 16;
    if constexpr (G == 1) {
        __m256i d[R][N], xv[N];
        for (int n = 0; n < N; ++n) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + n * p.ns));
            for (int r = 0; r < R; ++r) d[r][n] = c;
            xv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + n * p.cols));
        }
        for (int r = 0; r < R; ++r) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk(gbase, rg, r0 + r, off, 0, 32)));
            for (int n = 0; n < N; ++n) d[r][n] = _mm256_dpbusd_epi32(d[r][n], w, xv[n]);
        }
        for (int r = 0; r < R; ++r) {
            const float dw = _cvtsh_ss(p.scales[(j + r) * p.nb + b0]);
            for (int n = 0; n < N; ++n)
                acc[r][n] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(d[r][n])), _mm512_set1_ps(dw * dxl[n * p.ns]), acc[r][n]);
        }
    } else {
        __m512i d[R][N];
        for (int n = 0; n < N; ++n) {
            const __m512i c = _mm512_loadu_si512(corr + n * p.ns);
            for (int r = 0; r < R; ++r) d[r][n] = c;
        }
        for (int k = 0; k < G / 2; ++k) {
            __m512i xv[N];
            for (int n = 0; n < N; ++n) xv[n] = _mm512_loadu_si512(xq + n * p.cols + 64 * k);
            for (int r = 0; r < R; ++r) {
                const __m512i w = _mm512_loadu_si512(chunk(gbase, rg, r0 + r, off, k, 64));
                for (int n = 0; n < N; ++n) d[r][n] = _mm512_dpbusd_epi32(d[r][n], w, xv[n]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m512 dw = q8r_scales<G>(p.scales + (j + r) * p.nb + b0);
            for (int n = 0; n < N; ++n)
                acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][n]), _mm512_mul_ps(dw, _mm512_loadu_ps(dxl + n * p.ns)), acc[r][n]);
        }
    }
}

AVX512_FN inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {  // the lane sums of a, b, c, d
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// R rows (j...) times N tokens (t0...): every span, then y
template <int R, int N>
AVX512_FN void q8r_tile(const Q8R& p, const uint8_t* gbase, int64_t rg, int64_t r0, int64_t j, int64_t t0) {
    __m512 acc[R][N];
    for (int r = 0; r < R; ++r)
        for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
    for (size_t s = 0; s < p.spans.size(); ++s) {
        const int64_t si = static_cast<int64_t>(s), b0 = p.spans[s].b0;
        switch (p.spans[s].g) {
            case 16: q8r_span<16, R, N>(p, si, b0, gbase, rg, r0, j, t0, acc); break;
            case 8: q8r_span<8, R, N>(p, si, b0, gbase, rg, r0, j, t0, acc); break;
            case 4: q8r_span<4, R, N>(p, si, b0, gbase, rg, r0, j, t0, acc); break;
            case 2: q8r_span<2, R, N>(p, si, b0, gbase, rg, r0, j, t0, acc); break;
            default: q8r_span<1, R, N>(p, si, b0, gbase, rg, r0, j, t0, acc); break;
        }
    }
    alignas(16) float y[4];
    if constexpr (R == 2 && N % 2 == 0) {
        for (int n = 0; n < N; n += 2) {
            _mm_store_ps(y, reduce4(acc[0][n], acc[1][n], acc[0][n + 1], acc[1][n + 1]));
            float* o = p.out + (t0 + n) * p.out_stride + j;
            o[0] = y[0];
            o[1] = y[1];
            o[p.out_stride] = y[2];
            o[p.out_stride + 1] = y[3];
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int n = 0; n < N; ++n) p.out[(t0 + n) * p.out_stride + j + r] = _mm512_reduce_add_ps(acc[r][n]);
    }
}

// token t on the four rows of group q (rows 4q ... 4q + 3): q8r_span's work for R = 4, N = 1 with the
// span's blocks a value rather than a template argument.  This loop, not the unrolled tile, is what one
// token takes: the step's products 0.83-0.93x the time of q8r_tile<4, 1> on one and two threads.
AVX512_FN void q8r_one_token(const Q8R& p, int64_t q, int64_t t) {
    __m512 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* gbase = p.codes + 4 * q * p.cols;
    const int8_t* xt = p.xr.q.data() + t * p.cols;
    for (size_t si = 0; si < p.spans.size(); ++si) {
        const int64_t b0 = p.spans[si].b0, g = p.spans[si].g, off = b0 * QK;
        const int32_t* corr = p.xr.corr.data() + t * p.ns + static_cast<int64_t>(si) * 16;
        const float* dxl = p.xr.dxl.data() + t * p.ns + static_cast<int64_t>(si) * 16;
        if (g == 1) {  // one block in a 256-bit vector per row
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr));
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + off));
            for (int r = 0; r < 4; ++r) {
                const __m256i d = _mm256_dpbusd_epi32(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk(gbase, 4, r, off, 0, 32))), xv);
                const float dw = _cvtsh_ss(p.scales[(4 * q + r) * p.nb + b0]);
                acc[r] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(d)), _mm512_set1_ps(dw * dxl[0]), acc[r]);
            }
            continue;
        }
        __m512i d[4];
        const __m512i c = _mm512_loadu_si512(corr);
        for (int r = 0; r < 4; ++r) d[r] = c;
        for (int64_t k = 0; k < g / 2; ++k) {
            const __m512i xv = _mm512_loadu_si512(xt + off + 64 * k);
            for (int r = 0; r < 4; ++r) d[r] = _mm512_dpbusd_epi32(d[r], _mm512_loadu_si512(chunk(gbase, 4, r, off, k, 64)), xv);
        }
        const __m512 dx = _mm512_loadu_ps(dxl);
        for (int r = 0; r < 4; ++r) {
            const uint16_t* sc = p.scales + (4 * q + r) * p.nb + b0;
            const __m512 dw = g == 16 ? q8r_scales<16>(sc) : g == 8 ? q8r_scales<8>(sc) : g == 4 ? q8r_scales<4>(sc) : q8r_scales<2>(sc);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]), _mm512_mul_ps(dw, dx), acc[r]);
        }
    }
    _mm_storeu_ps(p.out + t * p.out_stride + 4 * q, reduce4(acc[0], acc[1], acc[2], acc[3]));
}

// groups [begin, end) of four rows (read from memory once, from L1 for the other tokens): tokens in
// tiles of 4 on 2 rows at a time, the rest one token at a time; group rows / 4 is the last rows % 4,
// one at a time
AVX512_FN void q8r_groups(const Q8R& p, int64_t T, int64_t rows, int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
        const int64_t j0 = 4 * q;
        if (j0 + 4 <= rows) {
            const uint8_t* gbase = p.codes + j0 * p.cols;
            int64_t t = 0;
            for (; t + 4 <= T; t += 4) {
                q8r_tile<2, 4>(p, gbase, 4, 0, j0, t);
                q8r_tile<2, 4>(p, gbase, 4, 2, j0 + 2, t);
            }
            for (; t < T; ++t) q8r_one_token(p, q, t);
            continue;
        }
        for (int64_t j = j0; j < rows; ++j) {
            const uint8_t* gbase = p.codes + j * p.cols;
            int64_t t = 0;
            for (; t + 4 <= T; t += 4) q8r_tile<1, 4>(p, gbase, 1, 0, j, t);
            for (; t < T; ++t) q8r_tile<1, 1>(p, gbase, 1, 0, j, t);
        }
    }
}

bool cpu_has_avx2() { return corerun_cpu::has_avx2(); }

bool cpu_has_avx512() {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vbmi");
}

// ---- the op ---------------------------------------------------------------------------------------

int64_t gguf_isa() { return cpu_has_avx512() ? AVX512 : cpu_has_avx2() ? AVX2 : SCALAR; }

bool isa_runs(int64_t isa) { return isa == SCALAR || (isa == AVX2 && cpu_has_avx2()) || (isa == AVX512 && cpu_has_avx512()); }

void gguf_gemv(at::Tensor out, const at::Tensor& blocks, const at::Tensor& x, int64_t type, int64_t isa) {
    TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1, "gguf_gemv: type must be 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1), got ", type);
    TORCH_CHECK(isa_runs(isa), "gguf_gemv: isa ", isa, " is not available on this CPU (best: ", gguf_isa(), ")");
    TORCH_CHECK(blocks.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu(), "gguf_gemv: CPU tensors only");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(), "gguf_gemv: blocks must be contiguous uint8 [rows, bytes], got ", blocks.scalar_type(), " ", blocks.sizes());
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "gguf_gemv: x must be contiguous float32 [T, cols], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), rows = blocks.size(0);
    TORCH_CHECK(cols % QK == 0, "gguf_gemv: cols must be a multiple of 32, got ", cols);
    const int64_t nb = cols / QK, row_bytes = nb * block_bytes(type);
    TORCH_CHECK(blocks.size(1) == row_bytes, "gguf_gemv: blocks have ", blocks.size(1), " bytes per row; ", cols, " columns of type ", type, " need ", row_bytes);
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == rows && out.stride(1) == 1,
                "gguf_gemv: out must be float32 [", T, ", ", rows, "] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    if (T == 0 || rows == 0) return;
    // about 64 KiB of blocks per task: enough work to pay for a thread's start
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes));
    if (isa == AVX512) {
        XQ xq;
        quantize_x_avx512(x.data_ptr<float>(), T, cols, type, xq);
        const uint8_t* bp = blocks.data_ptr<uint8_t>();
        float* op = out.data_ptr<float>();
        const int64_t os = out.stride(0);
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { rows_avx512(bp, xq, op, type, T, cols, os, begin, end); });
        return;
    }
    std::vector<float> xsum(static_cast<size_t>(T * nb), 0.f);
    const float* xp = x.data_ptr<float>();
    if (type != Q8_0) {
        for (int64_t t = 0; t < T; ++t)
            for (int64_t b = 0; b < nb; ++b) {
                float s = 0.f;
                for (int64_t i = 0; i < QK; ++i) s += xp[t * cols + b * QK + i];
                xsum[t * nb + b] = s;
            }
    }
    const Problem p{blocks.data_ptr<uint8_t>(), xp, xsum.data(), out.data_ptr<float>(), T, cols, nb, row_bytes, out.stride(0), type};
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        if (isa == AVX2) rows_avx2(p, begin, end);
        else rows_scalar(p, begin, end);
    });
}

void gguf_dequantize(at::Tensor out, const at::Tensor& blocks, int64_t type, int64_t isa) {
    TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1, "gguf_dequantize: type must be 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1), got ", type);
    TORCH_CHECK(isa_runs(isa), "gguf_dequantize: isa ", isa, " is not available on this CPU (best: ", gguf_isa(), ")");
    TORCH_CHECK(blocks.device().is_cpu() && out.device().is_cpu(), "gguf_dequantize: CPU tensors only");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(), "gguf_dequantize: blocks must be contiguous uint8 [rows, bytes], got ", blocks.scalar_type(), " ", blocks.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && out.size(0) == blocks.size(0) && out.size(1) % QK == 0,
                "gguf_dequantize: out must be contiguous float32 [", blocks.size(0), ", a multiple of 32], got ", out.scalar_type(), " ", out.sizes());
    const int64_t rows = out.size(0), nb = out.size(1) / QK, row_bytes = nb * block_bytes(type);
    TORCH_CHECK(blocks.size(1) == row_bytes, "gguf_dequantize: blocks have ", blocks.size(1), " bytes per row; ", out.size(1), " columns of type ", type, " need ", row_bytes);
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    float* wp = out.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        if (isa != SCALAR) dequant_avx2(bp, wp, type, nb, row_bytes, begin, end);  // AVX-512 decodes as AVX2 does
        else dequant_scalar(bp, wp, type, nb, row_bytes, begin, end);
    });
}

void gguf_gemv_q8(at::Tensor out, const at::Tensor& blocks, const at::Tensor& x, int64_t type) {
    TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1, "gguf_gemv_q8: type must be 0, 1 or 2, got ", type);
    TORCH_CHECK(cpu_has_avx2(), "gguf_gemv_q8: needs AVX2");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(), "gguf_gemv_q8: blocks must be contiguous uint8");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % QK == 0, "gguf_gemv_q8: x must be contiguous float32 [T, 32k]");
    const int64_t T = x.size(0), cols = x.size(1), rows = blocks.size(0);
    TORCH_CHECK(blocks.size(1) == cols / QK * block_bytes(type), "gguf_gemv_q8: blocks have ", blocks.size(1), " bytes per row");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == rows && out.stride(1) == 1, "gguf_gemv_q8: out must be float32 [T, rows]");
    const XQuant xq = quantize_x(x.data_ptr<float>(), T, cols);
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    const int64_t os = out.stride(0);
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, blocks.size(1)));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        if (type == Q8_0) rows_q8act_avx2<Q8_0>(bp, xq, op, T, cols, os, begin, end);
        else if (type == Q4_0) rows_q8act_avx2<Q4_0>(bp, xq, op, T, cols, os, begin, end);
        else rows_q8act_avx2<Q4_1>(bp, xq, op, T, cols, os, begin, end);
    });
}


void gguf_q8_0_repack(at::Tensor codes, at::Tensor scales, const at::Tensor& blocks) {
    TORCH_CHECK(blocks.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), "gguf_q8_0_repack: CPU tensors only");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(1) % 34 == 0,
                "gguf_q8_0_repack: blocks must be contiguous uint8 [rows, a multiple of 34 bytes], got ", blocks.scalar_type(), " ", blocks.sizes());
    const int64_t rows = blocks.size(0), nb = blocks.size(1) / 34, cols = nb * QK;
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(0) == rows && codes.size(1) == cols,
                "gguf_q8_0_repack: codes must be contiguous uint8 [", rows, ", ", cols, "], got ", codes.scalar_type(), " ", codes.sizes());
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == rows && scales.size(1) == nb,
                "gguf_q8_0_repack: scales must be contiguous float16 [", rows, ", ", nb, "], got ", scales.scalar_type(), " ", scales.sizes());
    const std::vector<Span> spans = q8r_spans(nb);
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    uint16_t* sp = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
    const int64_t rows4 = rows / 4 * 4;
    at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j)
            for (const Span& s : spans)
                for (int64_t m = 0; m < s.g; ++m) {
                    const uint8_t* blk = bp + j * nb * 34 + (s.b0 + m) * 34;
                    sp[j * nb + s.b0 + m] = load_u16(blk);
                    const int64_t rg = j < rows4 ? 4 : 1, cb = s.g == 1 ? 32 : 64;
                    const uint8_t* gbase = cp + (j < rows4 ? j / 4 * 4 : j) * cols;
                    for (int64_t u = 0; u < 8; ++u) {
                        const int64_t at = q8r_unit(s.g, m, u);
                        uint8_t* o = const_cast<uint8_t*>(chunk(gbase, rg, j < rows4 ? j % 4 : 0, s.b0 * QK, at / 64, cb)) + at % 64;
                        for (int i = 0; i < 4; ++i) o[i] = blk[2 + 4 * u + i] ^ 0x80;  // w + 128
                    }
                }
    });
}

void gguf_gemv_q8_0r(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& x) {
    TORCH_CHECK(cpu_has_avx512(), "gguf_gemv_q8_0r: needs AVX-512 (F, BW, VL, DQ, VBMI) with VNNI, which this CPU lacks");
    TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu(), "gguf_gemv_q8_0r: CPU tensors only");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % QK == 0,
                "gguf_gemv_q8_0r: x must be contiguous float32 [T, a multiple of 32], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), nb = cols / QK, rows = codes.size(0);
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == cols,
                "gguf_gemv_q8_0r: codes must be contiguous uint8 [rows, ", cols, "] (gguf_q8_0_repack's), got ", codes.scalar_type(), " ", codes.sizes());
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.is_contiguous() && scales.size(0) == rows && scales.size(1) == nb,
                "gguf_gemv_q8_0r: scales must be contiguous float16 [", rows, ", ", nb, "], got ", scales.scalar_type(), " ", scales.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == rows && out.stride(1) == 1,
                "gguf_gemv_q8_0r: out must be float32 [", T, ", ", rows, "] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    if (T == 0 || rows == 0) return;
    const std::vector<Span> spans = q8r_spans(nb);
    XR xr;
    quantize_x_q8r(x.data_ptr<float>(), T, cols, spans, xr);
    const Q8R p{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), xr, spans, out.data_ptr<float>(),
                cols, nb, static_cast<int64_t>(spans.size()) * 16, out.stride(0)};
    const int64_t grain = std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(1, cols));  // groups of 4 rows: about 64 KiB of codes per task
    at::parallel_for(0, (rows + 3) / 4, grain, [&](int64_t begin, int64_t end) { q8r_groups(p, T, rows, begin, end); });
}

// ---- AVX-512 + VNNI: 4-bit codes with float32 group scales and zero points ---------------------------
//
// GPTQ, AWQ and compressed-tensors pack-quantized (W4A16) store w = s_g (q - z_g): 4-bit codes q, a scale s
// and a zero point z per group of input features.  w4_gemv reads them repacked at load (kernels.py,
// repack_w4): the codes as Q4's nibbles (per row, each group of four 32-blocks one 64-byte vector whose
// byte 16 k + i holds values i (low nibble) and 16 + i (high) of block k; blocks after the last whole four,
// 16 bytes each in the same order), and per granule of GB = 1, 2 or 4 blocks (32, 64 or 128 features,
// GB dividing the group size) the scale s and c = -s z as float32.  x is quantized as for the Q4 paths
// (dx = max|x_b| / 127 per token and 32-block, sx = dx sum(qx)), and a block's share of y[t, j] is
//   s dx dot(q, qx) + c sx = s dx (dot(q, qx) - z sum(qx)),
// the product of the dequantized weights with the quantized activations, the integer dot exact.  The
// scales reach the float lanes as the block's 4 lanes need them: one broadcast (GB = 4), or a permute of
// two or four floats.

// A group's scales (or zero terms) on the 16 float lanes of its four blocks: lane l takes block l / 4's granule.
template <int GB>
AVX512_FN inline __m512 w4_lanes(const float* v, int64_t g) {
    if (GB == 4) return _mm512_set1_ps(v[g]);
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(GB == 2 ? _mm512_srli_epi32(lane_block, 1) : lane_block,
                                 _mm512_maskz_loadu_ps(GB == 1 ? 0xf : 0x3, v + g * 4 / GB));
}

template <int GB, int NT>
AVX512_FN void w4_row_tile(const uint8_t* codes, const float* s, const float* c, const XQ& xq, float* out,
                           int64_t out_stride, int64_t cols, int64_t t0, int64_t j) {
    const int64_t nb = cols / QK, groups = nb / 4;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 acc[NT], zacc[NT];  // the codes' sums and the zero terms: two chains of dependent adds, not one
    for (int n = 0; n < NT; ++n) acc[n] = zacc[n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const __m512i raw = _mm512_loadu_si512(codes + g * 64);
        const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        const __m512 d = w4_lanes<GB>(s, g), m = w4_lanes<GB>(c, g);
        for (int n = 0; n < NT; ++n) {
            const int8_t* xg = xq.q.data() + (t0 + n) * cols + g * 128;
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xg));
            p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(xg + 64));
            const float* de = xq.dxe.data() + ((t0 + n) * groups + g) * 16;
            const float* se = xq.sxe.data() + ((t0 + n) * groups + g) * 16;  // sx / 4 on each of the block's lanes
            acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_loadu_ps(de)), _mm512_cvtepi32_ps(p), acc[n]);
            zacc[n] = _mm512_fmadd_ps(m, _mm512_loadu_ps(se), zacc[n]);
        }
    }
    float tail[NT];  // the tail blocks' zero terms; their codes' sums stay in 8 float lanes to the end
    __m256 tacc[NT];
    for (int n = 0; n < NT; ++n) {
        tail[n] = 0.f;
        tacc[n] = _mm256_setzero_ps();
    }
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int64_t b = groups * 4; b < nb; ++b) {  // the blocks after the last whole four, one at a time
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 16));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        const float sb = s[b / GB], cb = c[b / GB];
        for (int n = 0; n < NT; ++n) {
            const int64_t t = t0 + n;
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + t * cols + b * QK));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv));
            tacc[n] = _mm256_fmadd_ps(_mm256_set1_ps(sb * xq.dx[t * nb + b]), dot, tacc[n]);
            tail[n] += cb * xq.sx[t * nb + b];
        }
    }
    for (int n = 0; n < NT; ++n) out[(t0 + n) * out_stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[n], zacc[n])) + hsum8_512(tacc[n]) + tail[n];
}

template <int GB>
AVX512_FN void w4_rows(const uint8_t* codes, const float* s, const float* c, const XQ& xq, float* out, int64_t T, int64_t cols,
                       int64_t out_stride, int64_t begin, int64_t end) {
    const int64_t row_bytes = cols / 2, grans = (cols / QK + GB - 1) / GB;
    for (int64_t j = begin; j < end; ++j) {  // tiles of tokens: one row's codes from L1 for every tile
        const uint8_t* row = codes + j * row_bytes;
        const float *sj = s + j * grans, *cj = c + j * grans;
        int64_t t = 0;
        for (; t + TILE <= T; t += TILE) w4_row_tile<GB, TILE>(row, sj, cj, xq, out, out_stride, cols, t, j);
        for (; t < T; ++t) w4_row_tile<GB, 1>(row, sj, cj, xq, out, out_stride, cols, t, j);
    }
}

void w4_gemv(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& negzs, const at::Tensor& x, int64_t gb) {
    TORCH_CHECK(cpu_has_avx512(), "w4_gemv: needs AVX-512 (F, BW, VL, DQ, VBMI) with VNNI, which this CPU lacks");
    TORCH_CHECK(gb == 1 || gb == 2 || gb == 4, "w4_gemv: blocks per granule must be 1, 2 or 4, got ", gb);
    TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && negzs.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu(),
                "w4_gemv: CPU tensors only");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % QK == 0,
                "w4_gemv: x must be contiguous float32 [T, a multiple of 32], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), rows = codes.size(0), grans = (cols / QK + gb - 1) / gb;
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == cols / 2,
                "w4_gemv: codes must be contiguous uint8 [rows, ", cols / 2, "] (repack_w4's), got ", codes.scalar_type(), " ", codes.sizes());
    for (const at::Tensor* t : {&scales, &negzs})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() && t->size(0) == rows && t->size(1) == grans,
                    "w4_gemv: scales and zero terms must be contiguous float32 [", rows, ", ", grans, "], got ", t->scalar_type(), " ", t->sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == rows && out.stride(1) == 1,
                "w4_gemv: out must be float32 [", T, ", ", rows, "] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    TORCH_CHECK(T <= 1 || out.stride(0) >= rows, "w4_gemv: out's rows overlap (stride ", out.stride(0), " for ", rows, " columns)");
    if (T == 0 || rows == 0 || cols == 0) {
        if (cols == 0) out.zero_();
        return;
    }
    XQ xq;
    quantize_x_avx512(x.data_ptr<float>(), T, cols, Q4_1, xq);
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const float *sp = scales.data_ptr<float>(), *zp = negzs.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t os = out.stride(0);
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, cols / 2));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        if (gb == 4) w4_rows<4>(cp, sp, zp, xq, op, T, cols, os, begin, end);
        else if (gb == 2) w4_rows<2>(cp, sp, zp, xq, op, T, cols, os, begin, end);
        else w4_rows<1>(cp, sp, zp, xq, op, T, cols, os, begin, end);
    });
}

// one row's blocks [b0, nb) decoded: s q + (-s z), sixteen values a vector (AVX-512 F)
__attribute__((target("avx512f,avx512bw,avx512vl"))) void w4_decode_row_avx512(const uint8_t* q, const float* s, const float* c, float* w,
                                                                                 int64_t nb, int64_t gb) {
    for (int64_t b = 0; b < nb; ++b) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
        const __m512 sb = _mm512_set1_ps(s[b / gb]), cb = _mm512_set1_ps(c[b / gb]);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(0x0f))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f))));
        _mm512_storeu_ps(w + b * QK, _mm512_add_ps(_mm512_mul_ps(sb, lo), cb));  // no FMA: the scalar path's two roundings
        _mm512_storeu_ps(w + b * QK + 16, _mm512_add_ps(_mm512_mul_ps(sb, hi), cb));
    }
}

void w4_dequantize(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& negzs, int64_t gb, int64_t isa) {
    TORCH_CHECK(isa_runs(isa), "w4_dequantize: isa ", isa, " is not available on this CPU (best: ", gguf_isa(), ")");
    TORCH_CHECK(gb == 1 || gb == 2 || gb == 4, "w4_dequantize: blocks per granule must be 1, 2 or 4, got ", gb);
    TORCH_CHECK(out.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu() && negzs.device().is_cpu(), "w4_dequantize: CPU tensors only");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && out.size(1) % QK == 0,
                "w4_dequantize: out must be contiguous float32 [rows, a multiple of 32], got ", out.scalar_type(), " ", out.sizes());
    const int64_t rows = out.size(0), cols = out.size(1), nb = cols / QK, grans = (nb + gb - 1) / gb;
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(0) == rows && codes.size(1) == cols / 2,
                "w4_dequantize: codes must be contiguous uint8 [", rows, ", ", cols / 2, "], got ", codes.scalar_type(), " ", codes.sizes());
    for (const at::Tensor* t : {&scales, &negzs})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() && t->size(0) == rows && t->size(1) == grans,
                    "w4_dequantize: scales and zero terms must be contiguous float32 [", rows, ", ", grans, "], got ", t->scalar_type(), " ", t->sizes());
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const float *sp = scales.data_ptr<float>(), *zp = negzs.data_ptr<float>();
    float* wp = out.data_ptr<float>();
    const bool wide = isa == AVX512;
    at::parallel_for(0, rows, std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, cols / 2)), [&](int64_t begin, int64_t end) {
        if (wide) {
            for (int64_t j = begin; j < end; ++j) w4_decode_row_avx512(cp + j * (cols / 2), sp + j * grans, zp + j * grans, wp + j * cols, nb, gb);
            return;
        }
        for (int64_t j = begin; j < end; ++j)
            for (int64_t b = 0; b < nb; ++b) {  // s q + (-s z): s (q - z) exactly where s has 11 bits or fewer (float16)
                const float sb = sp[j * grans + b / gb], cb = zp[j * grans + b / gb];
                const uint8_t* q = cp + j * (cols / 2) + b * 16;
                float* w = wp + j * cols + b * QK;
                for (int i = 0; i < 16; ++i) {
                    w[i] = sb * static_cast<float>(q[i] & 15) + cb;
                    w[16 + i] = sb * static_cast<float>(q[i] >> 4) + cb;
                }
            }
    });
}
}  // namespace

TORCH_LIBRARY(corerun_quant_cpu, m) {
    m.def("gguf_gemv(Tensor(a!) out, Tensor blocks, Tensor x, int type, int isa) -> ()");
    m.def("gguf_dequantize(Tensor(a!) out, Tensor blocks, int type, int isa) -> ()");
    m.def("gguf_gemv_q8(Tensor(a!) out, Tensor blocks, Tensor x, int type) -> ()");
    m.def("gguf_q8_0_repack(Tensor(a!) codes, Tensor(b!) scales, Tensor blocks) -> ()");
    m.def("gguf_gemv_q8_0r(Tensor(a!) out, Tensor codes, Tensor scales, Tensor x) -> ()");
    m.def("w4_gemv(Tensor(a!) out, Tensor codes, Tensor scales, Tensor negzs, Tensor x, int gb) -> ()");
    m.def("w4_dequantize(Tensor(a!) out, Tensor codes, Tensor scales, Tensor negzs, int gb, int isa) -> ()");
    m.def("gguf_isa() -> int", gguf_isa);  // no tensor arguments: a catch-all kernel
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) {
    m.impl("gguf_gemv", gguf_gemv);
    m.impl("gguf_dequantize", gguf_dequantize);
    m.impl("gguf_gemv_q8", gguf_gemv_q8);
    m.impl("gguf_q8_0_repack", gguf_q8_0_repack);
    m.impl("gguf_gemv_q8_0r", gguf_gemv_q8_0r);
    m.impl("w4_gemv", w4_gemv);
    m.impl("w4_dequantize", w4_dequantize);
}
