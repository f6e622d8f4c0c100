// GGUF's K types (256-value super-blocks: Q4_K, Q5_K, Q6_K) times float32 activations on CPU, read straight
// from the packed super-blocks.  The types of a Q4_K_M / Q5_K_M / Q6_K file, the ones most people download.
//
// Ops (registered as torch.ops.corerun_quant_cpu.*; see kernels.py):
//   gguf_k_gemv(out, blocks, x, type, isa)
//     blocks  uint8 [rows, cols / 256 * block_bytes], one GGML row per output feature, contiguous
//     x       float32 [T, cols], contiguous, cols a multiple of 256
//     out     float32 [T, rows], last dimension contiguous (a column slice of a wider output is fine)
//     type    GGML's numbers: 12 = Q4_K (144-byte super-blocks), 13 = Q5_K (176), 14 = Q6_K (210)
//     isa     kernels.py's ISAS: 2 = AVX-512 (F, BW, VL, DQ) + VNNI with int8 activations, 1 = AVX2 + FMA + F16C
//             (float32, the scalar path's arithmetic), each refused where the CPU lacks it; 0 = scalar
//   gguf_k_dequantize(out, blocks, type)
//     out     float32 [rows, cols] contiguous: the decoded weight (prefill: its product goes to torch's matmul)
//
// The formats (llama.cpp's; corerun/quantization/gguf_blocks.py decodes them in torch, the gguf package in tests):
//   Q4_K: f16 d, f16 dmin, 12 bytes holding eight 6-bit scales sc_j and eight 6-bit mins m_j (scale_min below),
//     128 bytes of nibbles.  Value q of sub-block j (32 values) is d sc_j q - dmin m_j.  The 256 values go as
//     four chunks of 64: chunk c's 32 bytes hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
//   Q5_K: as Q4_K with a fifth bit per value in qh[32] (after the scales, before the nibbles): value l of
//     sub-block 2c adds 16 when bit 2c of qh[l] is set, value l of sub-block 2c + 1 when bit 2c + 1 is.
//   Q6_K: ql[128], qh[64], sixteen int8 scales, f16 d last.  Two halves of 128 values; in half h (ql + 64h,
//     qh + 32h), for l < 32:  value l       = ql[l] & 15      | (qh[l] & 3) << 4
//                             value 32 + l  = ql[32 + l] & 15 | (qh[l] >> 2 & 3) << 4
//                             value 64 + l  = ql[l] >> 4      | (qh[l] >> 4 & 3) << 4
//                             value 96 + l  = ql[32 + l] >> 4 | (qh[l] >> 6) << 4
//     each minus 32, times d and the scale of its 16 values (value v of the super-block: scales[v / 16]).
//
// Scalar path: a super-block decoded into 256 floats on the stack (d sc and dmin m are exact in float32,
// so each value is rounded once, as the gguf package's decoder rounds it), then float32 dot products,
// tokens in tiles of 4 so that a row is read from memory once.
//
// AVX-512 + VNNI path, llama.cpp's approach as gguf_gemv.cpp's AVX-512 path takes it for Q4_1: x quantized
// once per call, per token and 32-block, to qx = round(x / dx) with dx = max|x_b| / 127 (|x - dx qx| <= dx / 2),
// codes in their natural order.  A chunk of 64 values is one 64-byte vector of unsigned codes (Q4_K / Q5_K:
// the low nibbles then the high ones, which are values 0-31 then 32-63 of the chunk: no permute; Q6_K: two
// 32-byte halves assembled the same way), multiplied by the chunk's 64 qx with vpdpbusd into 16 int32 lanes,
// four values each, exact.  Lane l of chunk c sums values 64c + 4l .. + 3, so its 32-block is 2c + l / 8 and
// (Q6_K) its scale 4c + l / 4: the per-lane scales are one vector per chunk, d sc (per row) times dx (per
// token: lanes 0-7 take block 2c's, 8-15 block 2c + 1's), and the sums stay in float32 lanes until the row ends.  Q4_K / Q5_K's minimums
// add -dmin m_j dx_j sum(qx) per sub-block (a scalar per token); Q6_K's -32 starts each lane at -32 times
// the sum of its four qx.  Error: at most half an activation step per value on top of float32's rounding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>

#include "cpu_features.h"

namespace {

enum KType : int64_t { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int64_t QK_K = 256;
constexpr int64_t KTILE = 4;  // tokens per pass over a row

int64_t k_block_bytes(int64_t type) { return type == Q4_K ? 144 : type == Q5_K ? 176 : 210; }

float half_bits_to_float(const uint8_t* p) {  // IEEE binary16 -> float32, exact
    uint16_t h;
    std::memcpy(&h, p, 2);
    return c10::detail::fp16_ieee_to_fp32_value(h);
}

// sub-block j's 6-bit scale and minimum from Q4_K / Q5_K's 12 bytes
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// ---- scalar ---------------------------------------------------------------------------------------

// always inlined: rows_k_avx2 compiles it again for AVX2 (vectorized there), rows_k_scalar for the baseline
__attribute__((always_inline)) inline void decode_super_block(int64_t type, const uint8_t* b, float* y) {
    if (type == Q6_K) {
        const float d = half_bits_to_float(b + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = b + 64 * h;
            const uint8_t* qh = b + 128 + 32 * h;
            float* yh = y + 128 * h;
            for (int l = 0; l < 32; ++l) {
                const int is = 8 * h + l / 16;
                yh[l] = d * static_cast<float>(sc[is]) * static_cast<float>(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
                yh[32 + l] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(((ql[32 + l] & 15) | (qh[l] >> 2 & 3) << 4) - 32);
                yh[64 + l] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32);
                yh[96 + l] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(((ql[32 + l] >> 4) | (qh[l] >> 6) << 4) - 32);
            }
        }
        return;
    }
    const float d = half_bits_to_float(b), dmin = half_bits_to_float(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K
    const uint8_t* qs = b + (type == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c) {
        int s0, m0, s1, m1;
        scale_min(scales, 2 * c, s0, m0);
        scale_min(scales, 2 * c + 1, s1, m1);
        const float d0 = d * static_cast<float>(s0), d1 = d * static_cast<float>(s1);
        const float n0 = dmin * static_cast<float>(m0), n1 = dmin * static_cast<float>(m1);
        for (int l = 0; l < 32; ++l) {
            int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
            if (type == Q5_K) {
                lo |= (qh[l] >> (2 * c) & 1) << 4;
                hi |= (qh[l] >> (2 * c + 1) & 1) << 4;
            }
            y[64 * c + l] = d0 * static_cast<float>(lo) - n0;
            y[64 * c + 32 + l] = d1 * static_cast<float>(hi) - n1;
        }
    }
}

struct KProblem {
    const uint8_t* blocks;
    const float* x;
    float* out;
    int64_t T, cols, nsb, row_bytes, out_stride, type;
};

void rows_k_scalar(const KProblem& p, int64_t begin, int64_t end) {
    float y[QK_K];
    for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = p.blocks + j * p.row_bytes;
        for (int64_t t0 = 0; t0 < p.T; t0 += KTILE) {
            const int64_t nt = std::min(KTILE, p.T - t0);
            float acc[KTILE] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t s = 0; s < p.nsb; ++s) {
                decode_super_block(p.type, row + s * k_block_bytes(p.type), y);
                for (int64_t k = 0; k < nt; ++k) {
                    const float* xs = p.x + (t0 + k) * p.cols + s * QK_K;
                    float a = 0.f;
                    for (int i = 0; i < QK_K; ++i) a += y[i] * xs[i];
                    acc[k] += a;
                }
            }
            for (int64_t k = 0; k < nt; ++k) p.out[(t0 + k) * p.out_stride + j] = acc[k];
        }
    }
}

// ---- AVX2 + FMA: the scalar path's decode compiled for AVX2, float32 dot products 8 lanes at a time -------------
//
// The same arithmetic as the scalar path (each value decoded and rounded once, float32 products), for CPUs with
// AVX2 but not the AVX-512 set (most laptops and desktops before Zen 4, Intel's client cores): a super-block
// decoded into 256 floats on the stack, then per token four accumulators of 8 lanes with FMA.

#define K2_FN __attribute__((target("avx2,fma,f16c")))

// Q6_K's decode, 8 values a vector (the compiler leaves the scalar loop's four interleaved outputs scalar): the same
// values as decode_super_block's, (d sc) times the code, rounded once
K2_FN void decode_q6k_avx2(const uint8_t* b, float* y) {
    const float d = half_bits_to_float(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; l += 8) {
            const int is = 8 * h + l / 16;
            const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + l)));
            const __m256i q2 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + 32 + l)));
            const __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh + l)));
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(q1, m15), _mm256_slli_epi32(_mm256_and_si256(hb, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(q2, m15), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), m3), 4)),
                _mm256_or_si256(_mm256_srli_epi32(q1, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), m3), 4)),
                _mm256_or_si256(_mm256_srli_epi32(q2, 4), _mm256_slli_epi32(_mm256_srli_epi32(hb, 6), 4)),
            };
            for (int k = 0; k < 4; ++k) {
                const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[is + 2 * k]));
                _mm256_store_ps(y + 128 * h + 32 * k + l, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_sub_epi32(v[k], off))));
            }
        }
    }
}

K2_FN void rows_k_avx2(const KProblem& p, int64_t begin, int64_t end) {
    alignas(32) float y[QK_K];
    for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = p.blocks + j * p.row_bytes;
        for (int64_t t0 = 0; t0 < p.T; t0 += KTILE) {
            const int64_t nt = std::min(KTILE, p.T - t0);
            __m256 acc[KTILE];
            for (int64_t k = 0; k < KTILE; ++k) acc[k] = _mm256_setzero_ps();
            for (int64_t s = 0; s < p.nsb; ++s) {
                if (p.type == Q6_K) decode_q6k_avx2(row + s * k_block_bytes(p.type), y);
                else decode_super_block(p.type, row + s * k_block_bytes(p.type), y);
                for (int64_t k = 0; k < nt; ++k) {
                    const float* xs = p.x + (t0 + k) * p.cols + s * QK_K;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int i = 0; i < QK_K; i += 32) {
                        a0 = _mm256_fmadd_ps(_mm256_load_ps(y + i), _mm256_loadu_ps(xs + i), a0);
                        a1 = _mm256_fmadd_ps(_mm256_load_ps(y + i + 8), _mm256_loadu_ps(xs + i + 8), a1);
                        a2 = _mm256_fmadd_ps(_mm256_load_ps(y + i + 16), _mm256_loadu_ps(xs + i + 16), a2);
                        a3 = _mm256_fmadd_ps(_mm256_load_ps(y + i + 24), _mm256_loadu_ps(xs + i + 24), a3);
                    }
                    acc[k] = _mm256_add_ps(acc[k], _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
                }
            }
            for (int64_t k = 0; k < nt; ++k) {
                __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[k]), _mm256_extractf128_ps(acc[k], 1));
                v = _mm_add_ps(v, _mm_movehl_ps(v, v));
                v = _mm_add_ss(v, _mm_movehdup_ps(v));
                p.out[(t0 + k) * p.out_stride + j] = _mm_cvtss_f32(v);
            }
        }
    }
}

// ---- AVX-512 + VNNI: int8 activations ----------------------------------------------------------------

#define K512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

struct KX {  // one call's quantized activations, per token, all in the values' natural order
    std::vector<int8_t> q;       // [T, cols]
    std::vector<float> dx;       // [T, cols / 32]: each 32-block's step
    std::vector<int32_t> c32;    // [T, cols / 4]: -32 times the sum of each int32 lane's four codes (Q6_K's offset only)
    std::vector<float> sx;       // [T, cols / 32]: dx sum(qx) per 32-block (Q4_K / Q5_K's minimums)
};

K512_FN void quantize_x_k(const float* x, int64_t T, int64_t cols, bool offsets, KX& r) {
    const int64_t nb = cols / 32;
    r.q.resize(static_cast<size_t>(T * cols));
    r.dx.resize(static_cast<size_t>(T * nb));
    r.c32.resize(offsets ? static_cast<size_t>(T * cols / 4) : 0);
    r.sx.resize(static_cast<size_t>(T * nb));
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // nearest, ties to even
            const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            int8_t* qb = r.q.data() + t * cols + b * 32;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(i0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(i1));
            r.sx[t * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
            r.dx[t * nb + b] = d;
            if (!offsets) continue;
            // the sums of each four codes: vpdpbusd of ones (unsigned) with the codes (signed)
            const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
            const __m256i s4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, codes);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.c32.data() + t * cols / 4 + b * 8), _mm256_mullo_epi32(s4, _mm256_set1_epi32(-32)));
        }
    }
}

// two 32-byte halves into one 64-byte vector
K512_FN inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// a super-block's four chunks of 64 unsigned codes, and per chunk its 16 lanes' weight scales (d sc)
template <int64_t TYPE>
K512_FN __attribute__((always_inline)) inline void unpack(const uint8_t* b, __m512i w[4], __m512 ds[4], float mins[8]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if constexpr (TYPE == Q6_K) {
        const float d = half_bits_to_float(b + 208);
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
            // a byte's two high bits (0-3) shifted by 4 within 16-bit words stay inside the byte
            const __m256i a = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            const __m256i bb = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
            const __m256i c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
            const __m256i e = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
            w[2 * h] = join(a, bb);
            w[2 * h + 1] = join(c, e);
        }
        // lane l of chunk c: scale 4c + l / 4
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
        const __m512 dv = _mm512_set1_ps(d);
        for (int c = 0; c < 4; ++c) {
            const __m128i idx = _mm_setr_epi8(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 2, 4 * c + 2,
                                              4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
            ds[c] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(sc, idx))));
        }
        return;
    }
    const float d = half_bits_to_float(b), dmin = half_bits_to_float(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (TYPE == Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i one = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (TYPE == Q5_K) {  // bit 2c (low nibbles) and 2c + 1 (high) of each qh byte, as 16
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        w[c] = join(lo, hi);
        int s0, m0, s1, m1;
        scale_min(scales, 2 * c, s0, m0);
        scale_min(scales, 2 * c + 1, s1, m1);
        ds[c] = _mm512_insertf32x8(_mm512_set1_ps(d * static_cast<float>(s0)), _mm256_set1_ps(d * static_cast<float>(s1)), 1);
        mins[2 * c] = dmin * static_cast<float>(m0);
        mins[2 * c + 1] = dmin * static_cast<float>(m1);
    }
}

struct KP512 {
    const uint8_t* blocks;
    const KX& xk;
    float* out;
    int64_t cols, nsb, row_bytes, out_stride;
};

// row j times tokens t0 .. t0 + NT - 1
template <int64_t TYPE, int NT>
K512_FN void row_k512(const KP512& p, int64_t j, int64_t t0) {
    __m512 acc[NT];
    float corr[NT];
    for (int k = 0; k < NT; ++k) {
        acc[k] = _mm512_setzero_ps();
        corr[k] = 0.f;
    }
    const uint8_t* row = p.blocks + j * p.row_bytes;
    const int64_t lanes = p.cols / 4, nb = p.cols / 32;
    for (int64_t s = 0; s < p.nsb; ++s) {
        __m512i w[4];
        __m512 ds[4];
        float mins[8];
        unpack<TYPE>(row + s * k_block_bytes(TYPE), w, ds, mins);
        for (int k = 0; k < NT; ++k) {
            const int64_t t = t0 + k;
            const int8_t* xq = p.xk.q.data() + t * p.cols + s * QK_K;
            const float* dx = p.xk.dx.data() + t * nb + s * 8;
            for (int c = 0; c < 4; ++c) {
                __m512i start = _mm512_setzero_si512();
                if constexpr (TYPE == Q6_K) start = _mm512_loadu_si512(p.xk.c32.data() + t * lanes + s * 64 + 16 * c);
                const __m512i dot = _mm512_dpbusd_epi32(start, w[c], _mm512_loadu_si512(xq + 64 * c));
                const __m512 dxv = _mm512_insertf32x8(_mm512_set1_ps(dx[2 * c]), _mm256_set1_ps(dx[2 * c + 1]), 1);  // lanes 0-7: block 2c
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds[c], dxv), acc[k]);
            }
            if constexpr (TYPE != Q6_K) {
                const float* sx = p.xk.sx.data() + t * nb + s * 8;
                for (int i = 0; i < 8; ++i) corr[k] -= mins[i] * sx[i];
            }
        }
    }
    for (int k = 0; k < NT; ++k) p.out[(t0 + k) * p.out_stride + j] = _mm512_reduce_add_ps(acc[k]) + corr[k];
}

template <int64_t TYPE>
K512_FN void rows_k512_typed(const KP512& p, int64_t T, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) row_k512<TYPE, 4>(p, j, t);
        switch (T - t) {
            case 3: row_k512<TYPE, 3>(p, j, t); break;
            case 2: row_k512<TYPE, 2>(p, j, t); break;
            case 1: row_k512<TYPE, 1>(p, j, t); break;
            default: break;
        }
    }
}

bool cpu_has_k512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

void check_type(const char* op, int64_t type) {
    TORCH_CHECK(type == Q4_K || type == Q5_K || type == Q6_K, op, ": type must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), got ", type);
}

// the blocks' shape against the columns, and the super-blocks per row
int64_t check_blocks(const char* op, const at::Tensor& blocks, int64_t cols, int64_t type) {
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
                op, ": blocks must be contiguous uint8 [rows, bytes] on the CPU, got ", blocks.scalar_type(), " ", blocks.sizes());
    TORCH_CHECK(cols % QK_K == 0, op, ": columns must be a multiple of 256 for the K types, got ", cols);
    const int64_t nsb = cols / QK_K;
    TORCH_CHECK(blocks.size(1) == nsb * k_block_bytes(type), op, ": blocks have ", blocks.size(1), " bytes per row; ", cols,
                " columns of type ", type, " need ", nsb * k_block_bytes(type));
    return nsb;
}

void gguf_k_gemv(at::Tensor out, const at::Tensor& blocks, const at::Tensor& x, int64_t type, int64_t isa) {
    check_type("gguf_k_gemv", type);
    TORCH_CHECK(isa >= 0 && isa <= 2, "gguf_k_gemv: isa must be 0 (scalar), 1 (avx2) or 2 (avx512), got ", isa);
    TORCH_CHECK(isa < 2 || cpu_has_k512(), "gguf_k_gemv: isa 2 needs AVX-512 (F, BW, VL, DQ) with VNNI, which this CPU lacks");
    TORCH_CHECK(isa != 1 || corerun_cpu::has_avx2(), "gguf_k_gemv: isa 1 needs AVX2, FMA and F16C, which this CPU lacks");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "gguf_k_gemv: x must be contiguous float32 [T, cols] on the CPU, got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1);
    const int64_t nsb = check_blocks("gguf_k_gemv", blocks, cols, type), rows = blocks.size(0);
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == rows &&
                    out.stride(1) == 1 && (T <= 1 || out.stride(0) >= rows),
                "gguf_k_gemv: out must be float32 [", T, ", ", rows, "] with a contiguous last dimension and rows that do not overlap, got ",
                out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
    if (T == 0 || rows == 0) return;
    if (cols == 0) {  // an empty sum
        out.zero_();
        return;
    }
    const int64_t row_bytes = blocks.size(1);
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / row_bytes);  // about 64 KiB of super-blocks per task
    if (isa == 2) {
        KX xk;
        quantize_x_k(x.data_ptr<float>(), T, cols, type == Q6_K, xk);
        const KP512 p{blocks.data_ptr<uint8_t>(), xk, out.data_ptr<float>(), cols, nsb, row_bytes, out.stride(0)};
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
            if (type == Q4_K) rows_k512_typed<Q4_K>(p, T, begin, end);
            else if (type == Q5_K) rows_k512_typed<Q5_K>(p, T, begin, end);
            else rows_k512_typed<Q6_K>(p, T, begin, end);
        });
        return;
    }
    const KProblem p{blocks.data_ptr<uint8_t>(), x.data_ptr<float>(), out.data_ptr<float>(), T, cols, nsb, row_bytes, out.stride(0), type};
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        if (isa == 1) rows_k_avx2(p, begin, end);
        else rows_k_scalar(p, begin, end);
    });
}

void gguf_k_dequantize(at::Tensor out, const at::Tensor& blocks, int64_t type) {
    check_type("gguf_k_dequantize", type);
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
                "gguf_k_dequantize: out must be contiguous float32 [rows, cols], got ", out.scalar_type(), " ", out.sizes());
    const int64_t cols = out.size(1), rows = out.size(0);
    const int64_t nsb = check_blocks("gguf_k_dequantize", blocks, cols, type);
    TORCH_CHECK(blocks.size(0) == rows, "gguf_k_dequantize: out has ", rows, " rows, blocks ", blocks.size(0));
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    float* wp = out.data_ptr<float>();
    const int64_t row_bytes = blocks.size(1), bb = k_block_bytes(type);
    at::parallel_for(0, rows, std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes)), [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j)
            for (int64_t s = 0; s < nsb; ++s) decode_super_block(type, bp + j * row_bytes + s * bb, wp + j * cols + s * QK_K);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corerun_quant_cpu, m) {
    m.def("gguf_k_gemv(Tensor(a!) out, Tensor blocks, Tensor x, int type, int isa) -> ()");
    m.def("gguf_k_dequantize(Tensor(a!) out, Tensor blocks, int type) -> ()");
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) {
    m.impl("gguf_k_gemv", gguf_k_gemv);
    m.impl("gguf_k_dequantize", gguf_k_dequantize);
}
