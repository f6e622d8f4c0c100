// Paged attention on CPU over corerun's KV cache, read in place through the block tables.
//
// C ABI (called through ctypes; see kernels.py for the argument order and meaning):
//   corerun_cpu_attention  one layer's attention for a batch of prefill chunks and decodes
//   corerun_cpu_write_kv   this step's K/V into the cache by slot mapping (-1 writes nothing)
//
// Layouts (strides in elements, last dimension contiguous):
//   query/out  [num_tokens, num_heads, head_size]
//   k/v cache  [num_blocks, block_size, num_kv_heads, head_size] in the query's dtype, or quantized (kv_type):
//              fp8 e4m3 / e5m2 bytes of value / k_scale (v_scale), or int8 rows of head_size values followed
//              by their float16 scale (head_size + 2 bytes; value = q * scale); strides then count bytes
//   query_start_loc int32 [num_reqs + 1], seq_lens int32 [num_reqs], block_tables int32 [num_reqs, width]
//
// Work item = (request, KV head, tile of up to TILE_ROWS / group query tokens): the query heads that
// share the KV head are processed together, so each K/V block is read from memory once per tile and
// then served from L1.  A decode (one query token) is one item for all its KV heads when there are
// enough decodes to keep the threads busy, and goes through decode_item (AVX-512; see there).  Each row keeps an online softmax (running max, running sum, float32
// accumulator) while the item walks its request's blocks up to the causal horizon of its last token;
// a row stops at its own horizon.  float32 accumulation for every dtype.
//
// Sliding window (window > 0): a row at position p reads only keys p - window + 1 .. p, so the item
// starts at the block holding its first token's earliest key and each row skips the keys before its
// own.  Soft cap (soft_cap > 0): each scaled score s becomes soft_cap * tanh(s / soft_cap).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum DType { F32 = 0, BF16 = 1, F16 = 2 };
enum KVType { KV_SAME = 0, KV_FP8_E4M3 = 1, KV_FP8_E5M2 = 2, KV_INT8 = 3 };
constexpr int64_t TILE_ROWS = 96;  // query rows (tokens x heads of one group) per work item
constexpr int64_t MAX_HEAD_SIZE = 256;
constexpr int64_t MAX_DECODE_HEADS = 256;  // query heads the decode path takes (more: the general path)

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

#if defined(__FLT16_MAX__)
inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return static_cast<float>(x);
}
inline uint16_t f32_to_f16(float f) {
    _Float16 x = static_cast<_Float16>(f);
    uint16_t h;
    std::memcpy(&h, &x, 2);
    return h;
}
#else
inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = std::ldexp(static_cast<float>(man), -24);
        return sign ? -f : f;
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t f32_to_f16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
    if (a < 0x38800000u) {  // subnormal half (or zero)
        float mag;
        std::memcpy(&mag, &a, 4);
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(mag * 16777216.0f)));
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
    return static_cast<uint16_t>(sign | (r >> 13));
}
#endif

// fp8 e4m3 (no infinities; 0x7f / 0xff are NaN) -> float, all 256 codes
struct E4M3Table {
    float v[256];
    E4M3Table() {
        for (int b = 0; b < 256; ++b) {
            const int exp = (b >> 3) & 0xf, man = b & 7;
            float f = exp == 0 ? std::ldexp(static_cast<float>(man), -9) : std::ldexp(static_cast<float>(8 + man), exp - 10);
            if (exp == 0xf && man == 7) f = NAN;
            v[b] = b & 0x80 ? -f : f;
        }
    }
};

inline const float* e4m3_table() {
    static const E4M3Table table;
    return table.v;
}

// One stored K or V row of a quantized cache -> D floats (e5m2 is the top byte of an IEEE half)
inline void dequant_row(int kv_type, const uint8_t* src, int64_t D, float scale, float* dst) {
    if (kv_type == KV_INT8) {
        uint16_t half;
        std::memcpy(&half, src + D, 2);
        const float s = f16_to_f32(half);
        const int8_t* q = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(q[d]) * s;
    } else if (kv_type == KV_FP8_E4M3) {
        const float* lut = e4m3_table();
        for (int64_t d = 0; d < D; ++d) dst[d] = lut[src[d]] * scale;
    } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = f16_to_f32(static_cast<uint16_t>(src[d]) << 8) * scale;
    }
}

template <int DT> struct Elem;
template <> struct Elem<F32> {
    using T = float;
    static inline float load(T x) { return x; }
    static inline T store(float x) { return x; }
};
template <> struct Elem<BF16> {
    using T = uint16_t;
    static inline float load(T x) { return bf16_to_f32(x); }
    static inline T store(float x) { return f32_to_bf16(x); }
};
template <> struct Elem<F16> {
    using T = uint16_t;
    static inline float load(T x) { return f16_to_f32(x); }
    static inline T store(float x) { return f32_to_f16(x); }
};

// exp(x) for x <= 0 in arithmetic the compiler vectorises: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 before rounding); 0 below -87.
inline float exp_nonpos(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest integer
    const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

// Ask for the next block's K/V rows of one head while this block is computed: the blocks of a
// sequence are scattered over the cache, so the hardware prefetcher cannot guess them.
template <typename T>
inline void prefetch_block(const T* kc, const T* vc, int64_t off, int64_t nkeys, int64_t kv_st, int64_t D) {
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j < nkeys; ++j) {
        const char* kr = reinterpret_cast<const char*>(kc + off + j * kv_st);
        const char* vr = reinterpret_cast<const char*>(vc + off + j * kv_st);
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch(kr + byte);
            __builtin_prefetch(vr + byte);
        }
    }
}

struct Args {
    const void* q;
    int64_t q_st, q_sh;
    const void* k;
    const void* v;
    int64_t kv_sb, kv_st, kv_sh;
    void* out;
    int64_t o_st, o_sh;
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* bt;
    int64_t bt_stride;
    int64_t num_heads, num_kv_heads, head_size, block_size;
    float scale;
    int64_t window;  // 0: full causal attention
    float soft_cap;  // 0: none
    int kv_type;     // KVType
    float k_scale, v_scale;  // fp8's per-tensor scales
};

struct Item {
    int32_t req, first, count;  // request, first query token of the tile (relative), tokens in the tile
    int32_t h0, nh;             // KV heads h0 .. h0 + nh - 1 (all of them for a decode, one for a prefill tile)
};

#if defined(__AVX512F__)
// s[0..15] = q . k_j for 16 keys (rows at kstride), head size HD a multiple of 16: sixteen AVX-512
// accumulators, then one transposing tree reduction (45 instructions) instead of sixteen horizontal sums.
inline __m512 sum16(const __m512* acc) {  // lane j of the result: the sum of acc[j]'s sixteen lanes
    __m512 u[8];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of keys 2i, 2i+1
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    __m512 w[4];
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of keys 4i .. 4i+3
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int HD>
inline __m512 scores16(const float* q, const float* krows, int64_t kstride) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < HD; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krows + j * kstride + d), acc[j]);
    }
    return sum16(acc);
}

#if defined(__AVX512BF16__)
// scores16 for bfloat16 query and key rows read as stored (HD a multiple of 32): vdpbf16ps multiplies
// pairs exactly and adds in float32, so no key is converted; the softmax scale is applied to the sums.
template <int HD>
inline __m512 scores16_bf16(const uint16_t* q, const uint16_t* krows, int64_t kstride) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < HD; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
        for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(krows + j * kstride + d));
    }
    return sum16(acc);
}
#endif

// exp_nonpos on sixteen lanes, the same steps (rounding to nearest, the same polynomial, 0 below -87)
inline __m512 exp_nonpos16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);  // x >= -87 or NaN
    const __m512 xc = _mm512_max_ps(lo, x);                         // NaN stays NaN
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-6f)));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
}

// row_block for one full block of 16 keys without a soft cap, all in registers: given the scores, their
// maximum and sum by vector reductions, the probabilities broadcast into two interleaved sets of
// accumulators (two dependency chains per 16 values of the head).
template <int HD>
inline void row_block16(__m512 sv, const float* vrows, int64_t kstride, float& mrow, float& lrow, float* ar) {
    const float bmax = _mm512_reduce_max_ps(sv);
    const float mold = mrow;
    const float mnew = bmax > mold ? bmax : mold;
    const __m512 p = exp_nonpos16(_mm512_sub_ps(sv, _mm512_set1_ps(mnew)));
    __m512 a0[HD / 16], a1[HD / 16];
    const __m512 alpha = _mm512_set1_ps(mnew != mold ? exp_nonpos(mold - mnew) : 1.0f);
    for (int c = 0; c < HD / 16; ++c) {
        a0[c] = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), alpha);
        a1[c] = _mm512_setzero_ps();
    }
    lrow = lrow * _mm512_cvtss_f32(alpha) + _mm512_reduce_add_ps(p);
    mrow = mnew;
    alignas(64) float ps[16];
    _mm512_store_ps(ps, p);
    for (int j = 0; j < 16; j += 2) {
        const __m512 p0 = _mm512_set1_ps(ps[j]), p1 = _mm512_set1_ps(ps[j + 1]);
        const float* v0 = vrows + j * kstride;
        const float* v1 = v0 + kstride;
        for (int c = 0; c < HD / 16; ++c) {
            a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), a0[c]);
            a1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), a1[c]);
        }
    }
    for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(ar + 16 * c, _mm512_add_ps(a0[c], a1[c]));
}
#endif

// One query row against one block's first n keys: scores, online-softmax update, V accumulation.
template <int HD>
inline void row_block(const float* qr, const float* krows, const float* vrows, int64_t kstride, int64_t n,
                      int64_t D_, float cap, float* s, float& mrow, float& lrow, float* ar) {
    const int64_t D = HD > 0 ? HD : D_;
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (HD > 0 && HD % 16 == 0) {
        if (n == 16 && cap == 0.0f) {
            row_block16<HD>(scores16<HD>(qr, krows, kstride), vrows, kstride, mrow, lrow, ar);
            return;
        }
        for (; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, scores16<HD>(qr, krows + j * kstride, kstride));
    }
#endif
    for (; j + 4 <= n; j += 4) {
        const float* k0 = krows + j * kstride;
        const float* k1 = k0 + kstride;
        const float* k2 = k1 + kstride;
        const float* k3 = k2 + kstride;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < D; ++d) {
            s0 += qr[d] * k0[d];
            s1 += qr[d] * k1[d];
            s2 += qr[d] * k2[d];
            s3 += qr[d] * k3[d];
        }
        s[j] = s0;
        s[j + 1] = s1;
        s[j + 2] = s2;
        s[j + 3] = s3;
    }
    for (; j < n; ++j) {
        const float* k0 = krows + j * kstride;
        float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
        for (int64_t d = 0; d < D; ++d) s0 += qr[d] * k0[d];
        s[j] = s0;
    }
    if (cap > 0.0f) {
        const float inv_cap = 1.0f / cap;
        for (int64_t jj = 0; jj < n; ++jj) s[jj] = cap * std::tanh(s[jj] * inv_cap);
    }
    float bmax = s[0];
    for (int64_t jj = 1; jj < n; ++jj) bmax = s[jj] > bmax ? s[jj] : bmax;
    const float mold = mrow;
    const float mnew = bmax > mold ? bmax : mold;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t jj = 0; jj < n; ++jj) {
        const float p = exp_nonpos(s[jj] - mnew);
        s[jj] = p;
        sum += p;
    }
    if (mnew != mold) {
        const float alpha = exp_nonpos(mold - mnew);
        lrow *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
    }
    lrow += sum;
    mrow = mnew;
    j = 0;
    for (; j + 4 <= n; j += 4) {
        const float* v0 = vrows + j * kstride;
        const float* v1 = v0 + kstride;
        const float* v2 = v1 + kstride;
        const float* v3 = v2 + kstride;
        const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; j < n; ++j) {
        const float* v0 = vrows + j * kstride;
        const float p0 = s[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p0 * v0[d];
    }
}

#if defined(__AVX512F__)
// ---- One query token (decodes): every query head of a KV head per K/V row ----
//
// An item of one query token walks its request's blocks (16 keys each) once for all its KV heads.  Per
// KV head, the query heads of its group take a block NG at a time (NG compile-time: up to 4 for head
// size 64, 2 for 128, so every accumulator stays in a register): their scores against the block's K rows
// (read from memory by the first, from L1 by the others), one online-softmax update per block, then
// each V row is loaded once and multiplied into all NG accumulators.  In bfloat16 both products run on
// vdpbf16ps with the rows as stored (nothing widened): q . k in pairs of dimensions, P . V in pairs of
// keys.  The next block of pages (after the last, the next item's first) is prefetched into L1 a part
// before each KV head of this one, and the whole block after it into L2 the same way.  (Only the first
// four lines of that one went to L2 before: on an AMD EPYC the V rows' loads then waited on memory, and
// 32 decodes of ~500 keys through 30 layers took 77 ms against 48 now; three blocks ahead took 55.)  float32, or bfloat16
// with AVX512_BF16; block size 16; sliding windows (masked lanes); no soft cap, no quantized cache:
// those take attend_item's general path.

// NG query heads (rows qrows[g], as stored for bfloat16, scaled float32 for float32) against one
// block's K/V rows (kstride elements apart; keys j0 .. nkeys - 1 are seen, the block's other rows are read
// but masked): online softmax into m, l, acc[g][HD].
template <int DT, int HD, int NG>
inline void decode_block(const void* const* qrows, float scale, const void* kb, const void* vb, int64_t kstride,
                         int64_t j0, int64_t nkeys, float* m, float* l, float* acc) {
    using T = typename Elem<DT>::T;
    const T* krows = static_cast<const T*>(kb);
    const T* vrows = static_cast<const T*>(vb);
    const __mmask16 valid = static_cast<__mmask16>(((1u << nkeys) - 1u) & ~((1u << j0) - 1u));
    __m512 p[NG];
    for (int g = 0; g < NG; ++g) {
        __m512 sv;
        if constexpr (DT == F32) {
            sv = scores16<HD>(static_cast<const float*>(qrows[g]), reinterpret_cast<const float*>(krows), kstride);
        } else {
#if defined(__AVX512BF16__)
            sv = _mm512_mul_ps(scores16_bf16<HD>(static_cast<const uint16_t*>(qrows[g]),
                                                 reinterpret_cast<const uint16_t*>(krows), kstride),
                               _mm512_set1_ps(scale));
#endif
        }
        p[g] = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sv);
    }
    __m512 a[NG][HD / 16];
    float alpha[NG];
    for (int g = 0; g < NG; ++g) {
        const float mold = m[g];
        const float bmax = _mm512_reduce_max_ps(p[g]);
        const float mnew = bmax > mold ? bmax : mold;
        p[g] = exp_nonpos16(_mm512_sub_ps(p[g], _mm512_set1_ps(mnew)));
        alpha[g] = mnew != mold ? exp_nonpos(mold - mnew) : 1.0f;
        m[g] = mnew;
        const __m512 av = _mm512_set1_ps(alpha[g]);
        for (int c = 0; c < HD / 16; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * HD + 16 * c), av);
    }
#if defined(__AVX512BF16__)
    if constexpr (DT == BF16) {
        // P rounded to bfloat16 (as flash attention's is) and multiplied into V two rows at a time by
        // vdpbf16ps: rows j and j + 1 interleaved in 16-bit pairs, against the pair (p_j, p_j+1).  The
        // accumulator's lanes are then in the unpack's order (see bf16_pairs_to_dims); l sums the rounded P.
        alignas(64) uint32_t pw[NG][8];
        for (int g = 0; g < NG; ++g) {
            const __m256bh pb = _mm512_cvtneps_pbh(p[g]);
            l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(_mm512_cvtpbh_ps(pb));
            _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g]), (__m256i)pb);
        }
        for (int64_t j = j0 & ~int64_t{1}; j < nkeys; j += 2) {
            // a row outside j0 .. nkeys - 1 (its p is 0) is read as zeros: never 0 * a stale inf
            const __mmask32 m0 = j >= j0 ? ~__mmask32{0} : 0, m1 = j + 1 < nkeys ? ~__mmask32{0} : 0;
            const uint16_t* r0 = reinterpret_cast<const uint16_t*>(vrows + j * kstride);
            const uint16_t* r1 = reinterpret_cast<const uint16_t*>(vrows + (j + 1) * kstride);
            __m512i lo[HD / 32], hi[HD / 32];
            for (int c = 0; c < HD / 32; ++c) {
                const __m512i x0 = _mm512_maskz_loadu_epi16(m0, r0 + 32 * c), x1 = _mm512_maskz_loadu_epi16(m1, r1 + 32 * c);
                lo[c] = _mm512_unpacklo_epi16(x0, x1);
                hi[c] = _mm512_unpackhi_epi16(x0, x1);
            }
            for (int g = 0; g < NG; ++g) {
                const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][j / 2]));
                for (int c = 0; c < HD / 32; ++c) {
                    a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo[c], pj);
                    a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi[c], pj);
                }
            }
        }
    } else
#endif
    {
        alignas(64) float ps[NG][16];
        for (int g = 0; g < NG; ++g) {
            l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(p[g]);
            _mm512_store_ps(ps[g], p[g]);
        }
        for (int64_t j = j0; j < nkeys; ++j) {
            const float* vr = reinterpret_cast<const float*>(vrows + j * kstride);
            __m512 v[HD / 16];
            for (int c = 0; c < HD / 16; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
            for (int g = 0; g < NG; ++g) {
                const __m512 pj = _mm512_set1_ps(ps[g][j]);
                for (int c = 0; c < HD / 16; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
            }
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(acc + g * HD + 16 * c, a[g][c]);
}

#if defined(__AVX512BF16__)
// decode_block's bfloat16 accumulator -> head order: of each 32 dimensions, vector 2c holds (per 128-bit
// lane k) dimensions 8k .. 8k + 3 and vector 2c + 1 dimensions 8k + 4 .. 8k + 7 (unpacklo / unpackhi).
template <int HD>
inline void bf16_pairs_to_dims(const float* acc, float scale, float* out) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int c = 0; c < HD / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
        _mm512_storeu_ps(out + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), sv));
        _mm512_storeu_ps(out + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), sv));
    }
}
#endif

template <int DT, int HD>
constexpr bool has_decode_path() {
#if defined(__AVX512BF16__)
    return (DT == F32 || DT == BF16) && (HD == 64 || HD == 128);
#else
    return DT == F32 && (HD == 64 || HD == 128);
#endif
}

// Part `part` of `parts` of the K and V spans starting at k and v (bytes long) into L1 (HINT T0; T1: L2): the
// next block is asked for a part before each KV head of this one, so the requests spread over the block's
// compute instead of filling every line fill buffer at once; the block after it the same way into L2.
template <int HINT = _MM_HINT_T0>
inline void prefetch_part(const char* k, const char* v, int64_t bytes, int64_t part, int64_t parts) {
    const int64_t lead = reinterpret_cast<uintptr_t>(k) & 63;  // k and v share their offset in the line
    k -= lead;
    v -= lead;
    bytes += lead;
    const int64_t step = ((bytes + parts * 64 - 1) / (parts * 64)) * 64;
    const int64_t from = part * step, to = from + step < bytes ? from + step : bytes;
    for (int64_t x = from; x < to; x += 64) {
        _mm_prefetch(k + x, static_cast<_mm_hint>(HINT));
        _mm_prefetch(v + x, static_cast<_mm_hint>(HINT));
    }
}

template <int DT, int HD, int NGMAX>
inline void decode_group(int64_t ng, const void* const* qrows, float scale, const void* kb, const void* vb,
                         int64_t kstride, int64_t j0, int64_t nkeys, float* m, float* l, float* acc) {
    if (ng >= NGMAX) {
        decode_block<DT, HD, NGMAX>(qrows, scale, kb, vb, kstride, j0, nkeys, m, l, acc);
    } else if (ng == 1) {
        decode_block<DT, HD, 1>(qrows, scale, kb, vb, kstride, j0, nkeys, m, l, acc);
    } else if constexpr (NGMAX > 2) {
        if (ng == 2) decode_block<DT, HD, 2>(qrows, scale, kb, vb, kstride, j0, nkeys, m, l, acc);
        else decode_block<DT, HD, 3>(qrows, scale, kb, vb, kstride, j0, nkeys, m, l, acc);
    }
}

// The query token of a one-token item and the keys it sees, lo .. hz - 1.
inline void one_token_range(const Args& a, const Item& it, int64_t& row, int64_t& hz, int64_t& lo) {
    const int64_t qlen = a.qsl[it.req + 1] - a.qsl[it.req];
    row = a.qsl[it.req] + it.first;
    hz = a.seq_lens[it.req] - qlen + it.first + 1;
    lo = a.window > 0 && hz > a.window ? hz - a.window : 0;
}

// An item of one query token (a decode, or a prefill tile of one token), KV heads h0 .. h0 + nh - 1,
// in attend_item's layout of buf; next: the item after it in the list (its first block is prefetched
// during this one's last), or null.
template <int DT, int HD>
void decode_item(const Args& a, const Item& it, const Item* next, float* buf) {
    using E = Elem<DT>;
    using T = typename E::T;
    constexpr int NGMAX = HD == 64 ? 4 : 2;
    constexpr int64_t BS = 16;
    const int64_t G = a.num_heads / a.num_kv_heads, nh = it.nh, h0 = it.h0;
    const int64_t M = nh * G;
    const int32_t* table = a.bt + it.req * a.bt_stride;
    int64_t row, hz, lo;  // the query token; it sees keys lo .. hz - 1
    one_token_range(a, it, row, hz, lo);
    float* qf = buf;           // [M][HD] scaled query rows (float32)
    float* acc = qf + M * HD;  // [M][HD]
    float* mrow = acc + M * HD;
    float* lrow = mrow + M;
    const void* qrows[MAX_DECODE_HEADS];
    const T* qbase = static_cast<const T*>(a.q) + row * a.q_st;
    for (int64_t r = 0; r < M; ++r) {
        const T* src = qbase + (h0 * G + r) * a.q_sh;
        if constexpr (DT == F32) {
#pragma omp simd
            for (int64_t d = 0; d < HD; ++d) qf[r * HD + d] = src[d] * a.scale;
            qrows[r] = qf + r * HD;
        } else {
            qrows[r] = src;
        }
        mrow[r] = -INFINITY;
        lrow[r] = 0.0f;
    }
    for (int64_t i = 0; i < M * HD; ++i) acc[i] = 0.0f;
    const T* kc = static_cast<const T*>(a.k);
    const T* vc = static_cast<const T*>(a.v);
    // the heads h0 .. h0 + nh - 1 of one block: one span of memory when a row's heads are adjacent (the usual layout)
    const bool span = a.kv_sh == HD;
    const auto span_bytes = [&](int64_t heads) { return ((BS - 1) * a.kv_st + heads * HD) * static_cast<int64_t>(sizeof(T)); };
    const int64_t nblocks = (hz + BS - 1) / BS;
    int64_t next_off = -1, next_bytes = 0;  // the span read after this item's last block
    if (span && next != nullptr && next->count == 1) {
        int64_t nrow, nhz, nlo;
        one_token_range(a, *next, nrow, nhz, nlo);
        next_off = static_cast<int64_t>(a.bt[next->req * a.bt_stride + nlo / BS]) * a.kv_sb + next->h0 * a.kv_sh;
        next_bytes = span_bytes(next->nh);
    }
    for (int64_t b = lo / BS; b < nblocks; ++b) {
        const int64_t start = b * BS;
        const int64_t nkeys = hz - start < BS ? hz - start : BS;
        const int64_t j0 = lo > start ? lo - start : 0;
        const int64_t base = static_cast<int64_t>(table[b]) * a.kv_sb + h0 * a.kv_sh;
        const int64_t pf_off = b + 1 < nblocks ? static_cast<int64_t>(table[b + 1]) * a.kv_sb + h0 * a.kv_sh : next_off;
        const int64_t pf_bytes = b + 1 < nblocks ? span_bytes(nh) : next_bytes;
        for (int64_t hh = 0; hh < nh; ++hh) {
            if (span && pf_off >= 0)
                prefetch_part(reinterpret_cast<const char*>(kc + pf_off), reinterpret_cast<const char*>(vc + pf_off), pf_bytes, hh, nh);
            if (span && b + 2 < nblocks) {  // the block after the next: into L2, a part before each KV head
                const int64_t after = static_cast<int64_t>(table[b + 2]) * a.kv_sb + h0 * a.kv_sh;
                prefetch_part<_MM_HINT_T1>(reinterpret_cast<const char*>(kc + after), reinterpret_cast<const char*>(vc + after), span_bytes(nh), hh, nh);
            }
            const T* kb = kc + base + hh * a.kv_sh;
            const T* vb = vc + base + hh * a.kv_sh;
            for (int64_t g0 = 0; g0 < G; g0 += NGMAX) {
                const int64_t r = hh * G + g0;
                decode_group<DT, HD, NGMAX>(G - g0, qrows + r, a.scale, kb, vb, a.kv_st, j0, nkeys, mrow + r, lrow + r,
                                            acc + r * HD);
            }
        }
    }
    T* obase = static_cast<T*>(a.out) + row * a.o_st;
    for (int64_t r = 0; r < M; ++r) {
        T* dst = obase + (h0 * G + r) * a.o_sh;
        const float inv = 1.0f / lrow[r];
        const float* ar = acc + r * HD;
#if defined(__AVX512BF16__)
        if constexpr (DT == BF16) {
            alignas(64) float o[HD];
            bf16_pairs_to_dims<HD>(ar, inv, o);
#pragma omp simd
            for (int64_t d = 0; d < HD; ++d) dst[d] = E::store(o[d]);
            continue;
        }
#endif
#pragma omp simd
        for (int64_t d = 0; d < HD; ++d) dst[d] = E::store(ar[d] * inv);
    }
}
#endif

#if defined(__AVX512F__)
// ---- Prefill tiles: a block of query rows against each block of 16 keys ----
//
// An item of several query tokens of one KV head (rows m = token * G + g, the G query heads of the group)
// walks its request's blocks up to the causal horizon of its last token.  The softmax runs across rows,
// sixteen rows to a vector, so that no step of it needs a horizontal reduction:
//   - the item's queries are scaled by scale * log2(e) and transposed once (qT[d][m], rows padded to a
//     multiple of 16); per block, K and V are converted to float32 once for all the item's rows (kf, vf);
//   - per sixteen rows, sixteen score vectors s_j (key j of the block, lane = row), each qT[d] loaded once
//     for the sixteen keys and multiplied by k_j[d] broadcast; keys at or past a row's horizon masked;
//   - the online softmax in base 2 on those vectors: the block's maximum by vertical maxima, 2^(s_j - m)
//     by a polynomial and VSCALEFPS, the running sum by vertical adds; the probabilities stored key-major;
//   - P . V for 384 / HD rows at a time (each V row loaded once for them, their accumulators in registers).
// Row vectors wholly before the block's first visible key skip it.  Any dtype (float32 arithmetic; bfloat16
// with AVX512_BF16 goes to prefill_tile_bf16, the same steps on vdpbf16ps); block
// size 16, head size 64 or 128; no quantized cache, sliding window or soft cap (those take attend_item's
// general path).  Measured against the per-row softmax it replaces (horizontal maximum and sum per row and
// block, K transposed per block): benchmarks/RESULTS.md, "Thirteenth session".

// 2^x for x <= 0 on sixteen lanes: x = n + f, |f| <= 1/2, 2^f by the degree-7 Taylor polynomial of
// e^(f ln 2) (relative error < 1e-8 before rounding), scaled by 2^n; 0 below -126, NaN stays NaN.
inline __m512 exp2_nonpos16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-126.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);  // x >= -126 or NaN
    const __m512 xc = _mm512_max_ps(lo, x);                         // NaN stays NaN
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);                    // ln2^7 / 7!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-04f));  // ln2^6 / 6!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));  // ln2^5 / 5!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));  // ln2^4 / 4!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));  // ln2^3 / 3!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));  // ln2^2 / 2!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));  // ln2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

// acc[r] = acc[r] * alpha[r] + sum_j p[j * pstride + r] * v_j for R rows (probabilities key-major).
template <int HD, int R>
inline void tile_pv(const float* p, int64_t pstride, const float* alpha, const float* vf, float* acc) {
    constexpr int C = HD / 16;
    __m512 o[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * HD + 16 * c), al);
    }
    for (int j = 0; j < 16; ++j) {
        __m512 pb[R];  // each row's probability broadcast once, for the C products of the row
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pb[r] = _mm512_set1_ps(p[j * pstride + r]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m512 v = _mm512_loadu_ps(vf + j * HD + 16 * c);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) o[r][c] = _mm512_fmadd_ps(pb[r], v, o[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * HD + 16 * c, o[r][c]);
}

// Sixteen stored values as float32.
template <int DT>
inline __m512 load16(const typename Elem<DT>::T* src) {
    if constexpr (DT == F32) {
        return _mm512_loadu_ps(src);
    } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        if constexpr (DT == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        else return _mm512_cvtph_ps(h);
    }
}

// Scores of sixteen rows (qT: [HD][mp], this vector's lanes at qT) against the block's 16 keys (kf [16][HD]):
// s[j] lane r = q_r . k_j, in base-2 units (the queries carry log2(e)).
template <int HD>
inline void scores_by_key(const float* qT, int64_t mp, const float* kf, __m512* s) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int d = 0; d < HD; ++d) {
        const __m512 q = _mm512_loadu_ps(qT + d * mp);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(kf[j * HD + d]), s[j]);
    }
}

// A prefill tile's rows: M = its tokens x the G query heads of its KV head, padded to MP (a multiple of 16);
// the first query token's index in the step, the keys its first and last token see, its request's block table.
struct TileShape {
    int64_t G, M, MP, q0, first_hz, max_hz;
    const int32_t* table;
};

inline TileShape tile_shape(const Args& a, const Item& it) {
    TileShape t;
    t.G = a.num_heads / a.num_kv_heads;
    t.M = it.count * t.G;
    t.MP = (t.M + 15) / 16 * 16;
    const int64_t q0 = a.qsl[it.req], qlen = a.qsl[it.req + 1] - q0;
    t.q0 = q0 + it.first;
    t.first_hz = a.seq_lens[it.req] - qlen + it.first + 1;
    t.max_hz = t.first_hz + it.count - 1;
    t.table = a.bt + it.req * a.bt_stride;
    return t;
}

// Each row's horizon (padding rows: the first row's), running maximum and sum; the accumulators [MP][HD] zeroed.
inline void tile_start(const TileShape& t, int64_t HD, int32_t* hz, float* mrow, float* lrow, float* acc) {
    for (int64_t m = 0; m < t.MP; ++m) {
        hz[m] = static_cast<int32_t>(m < t.M ? t.first_hz + m / t.G : t.first_hz);
        mrow[m] = -INFINITY;
        lrow[m] = 0.0f;
    }
    for (int64_t i = 0; i < t.MP * HD; ++i) acc[i] = 0.0f;
}

// The online softmax's first half for sixteen rows (from m) against the block of keys from start: keys at or
// past a row's horizon masked in s (also those past the block's live keys, whose rows may hold anything), the
// block's maximum folded into the running maximum (stored, and returned), the old sum's factor into alpha.
inline __m512 tile_max16(__m512* s, const int32_t* hz, int64_t start, float* mrow, float* alpha) {
    if (start + 16 > hz[0]) {  // some key of the block is at or past some row's horizon: mask them
        const __m512i rows_hz = _mm512_loadu_si512(hz);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __mmask16 live = _mm512_cmpgt_epi32_mask(rows_hz, _mm512_set1_epi32(static_cast<int>(start + j)));
            s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s[j]);
        }
    }
    __m512 bmax = s[0];
#pragma GCC unroll 16
    for (int j = 1; j < 16; ++j) bmax = _mm512_max_ps(bmax, s[j]);
    const __m512 mold = _mm512_loadu_ps(mrow);
    const __m512 mnew = _mm512_max_ps(mold, bmax);
    // every row sees key 0, so a row's maximum is finite from the first block on
    _mm512_storeu_ps(alpha, exp2_nonpos16(_mm512_sub_ps(mold, mnew)));
    _mm512_storeu_ps(mrow, mnew);
    return mnew;
}

// The rows of this block's P . V (from v0, the first row vector that sees the block), RP at a time, then 2, then 1.
template <int RP, typename PV>
inline void tile_pv_rows(int64_t v0, int64_t M, PV pv) {
    int64_t m = v0;
    for (; m + RP <= M; m += RP) pv(m, std::integral_constant<int, RP>{});
    for (; m + 2 <= M; m += 2) pv(m, std::integral_constant<int, 2>{});
    if (m < M) pv(m, std::integral_constant<int, 1>{});
}

// Each row's output: its accumulator over its running sum, in the query's dtype.
template <int DT, int HD>
inline void tile_finish(const Args& a, const Item& it, const TileShape& t, const float* acc, const float* lrow) {
    using E = Elem<DT>;
    typename E::T* obase = static_cast<typename E::T*>(a.out);
    for (int64_t m = 0; m < t.M; ++m) {
        typename E::T* dst = obase + (t.q0 + m / t.G) * a.o_st + (it.h0 * t.G + m % t.G) * a.o_sh;
        const float inv = 1.0f / lrow[m];
        const float* ar = acc + m * HD;
#pragma omp simd
        for (int64_t d = 0; d < HD; ++d) dst[d] = E::store(ar[d] * inv);
    }
}

template <int DT, int HD>
void prefill_tile(const Args& a, const Item& it, float* buf) {
    using E = Elem<DT>;
    using T = typename E::T;
    constexpr int64_t BS = 16, RP = 384 / HD;  // rows per P . V pass: 24 accumulators (four at 256 / HD were 2-3 % slower)
    const TileShape t = tile_shape(a, it);
    const int64_t G = t.G, M = t.M, MP = t.MP, h = it.h0;

    float* qT = buf;               // [HD][MP] scaled query rows, transposed (padding rows 0)
    float* acc = qT + HD * MP;     // [MP][HD]
    float* mrow = acc + MP * HD;   // [MP] running maximum (base 2)
    float* lrow = mrow + MP;       // [MP] running sum
    float* alpha = lrow + MP;      // [MP]
    int32_t* hz = reinterpret_cast<int32_t*>(alpha + MP);  // [MP] keys each row sees (padding: the first row's)
    float* p = alpha + 2 * MP;     // [16][MP] probabilities, key-major
    float* kf = p + BS * MP;       // [16][HD]
    float* vf = kf + BS * HD;      // [16][HD]

    const float qscale = a.scale * 1.44269504088896341f;
    const T* qbase = static_cast<const T*>(a.q);
    for (int64_t m = 0; m < MP; ++m) {
        if (m < M) {
            const T* src = qbase + (t.q0 + m / G) * a.q_st + (h * G + m % G) * a.q_sh;
            for (int64_t d = 0; d < HD; ++d) qT[d * MP + m] = E::load(src[d]) * qscale;
        } else {
            for (int64_t d = 0; d < HD; ++d) qT[d * MP + m] = 0.0f;
        }
    }
    tile_start(t, HD, hz, mrow, lrow, acc);

    const T* kc = static_cast<const T*>(a.k);
    const T* vc = static_cast<const T*>(a.v);
    const int64_t nblocks = (t.max_hz + BS - 1) / BS;
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = b * BS;
        const int64_t nkeys = t.max_hz - start < BS ? t.max_hz - start : BS;
        if (b + 1 < nblocks) {
            const int64_t next_keys = t.max_hz - start - BS < BS ? t.max_hz - start - BS : BS;
            prefetch_block<T>(kc, vc, static_cast<int64_t>(t.table[b + 1]) * a.kv_sb + h * a.kv_sh, next_keys, a.kv_st, HD);
        }
        const int64_t off = static_cast<int64_t>(t.table[b]) * a.kv_sb + h * a.kv_sh;
        for (int64_t j = 0; j < BS; ++j) {  // keys past nkeys as zeros (masked, and their probabilities are 0)
            const bool live = j < nkeys;
            for (int64_t c = 0; c < HD; c += 16) {
                _mm512_storeu_ps(kf + j * HD + c, live ? load16<DT>(kc + off + j * a.kv_st + c) : _mm512_setzero_ps());
                _mm512_storeu_ps(vf + j * HD + c, live ? load16<DT>(vc + off + j * a.kv_st + c) : _mm512_setzero_ps());
            }
        }
        // token ti sees keys < first_hz + ti: the rows before m0 see none of this block
        const int64_t m0 = (start >= t.first_hz ? start - t.first_hz + 1 : 0) * G;
        const int64_t v0 = m0 / 16 * 16;
        for (int64_t m = v0; m < MP; m += 16) {
            __m512 s[16];
            scores_by_key<HD>(qT + m, MP, kf, s);
            const __m512 mnew = tile_max16(s, hz + m, start, mrow + m, alpha + m);
            __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                const __m512 e = exp2_nonpos16(_mm512_sub_ps(s[j], mnew));
                sum = _mm512_add_ps(sum, e);
                _mm512_storeu_ps(p + j * MP + m, e);
            }
            _mm512_storeu_ps(lrow + m, _mm512_fmadd_ps(_mm512_loadu_ps(lrow + m), _mm512_loadu_ps(alpha + m), sum));
        }
        tile_pv_rows<RP>(v0, M, [&](int64_t m, auto r) { tile_pv<HD, decltype(r)::value>(p + m, MP, alpha + m, vf, acc + m * HD); });
    }
    tile_finish<DT, HD>(a, it, t, acc, lrow);
}
#endif

#if defined(__AVX512BF16__)
// ---- Prefill tiles in bfloat16 on AVX512_BF16 ----
//
// prefill_tile with both products on vdpbf16ps, the rows read as stored (nothing widened to float32):
//   - q . k in pairs of dimensions: the item's query rows transposed once into 32-bit pairs (qP[d / 2][m],
//     unscaled; the scale and log2(e) multiply the sums), each key's pair of dimensions broadcast straight
//     from the cache, so K is never converted;
//   - P . V in pairs of keys: per block the V rows interleaved in pairs once for all the item's rows
//     (vP[j / 2][d], dead keys as zeros), the probabilities rounded to bfloat16 in pairs (pP[j / 2][m]), as
//     the decode path's and the AMX call's are, and the running sum adds the rounded values.
// Half the multiply instructions of the float32 tile; the softmax steps are prefill_tile's.
// Measured: benchmarks/RESULTS.md, "Seventeenth session".

// Two sets of sixteen float32 values -> bfloat16 pairs (a's in the low half of each 32-bit lane, b's in the
// high half), rounded to nearest even; also a + b as rounded, for the running sum.
inline __m512i bf16_pairs(__m512 a, __m512 b, __m512& rounded_sum) {
    const __m256i ha = (__m256i)_mm512_cvtneps_pbh(a), hb = (__m256i)_mm512_cvtneps_pbh(b);
    const __m512i wa = _mm512_cvtepu16_epi32(ha), wb = _mm512_cvtepu16_epi32(hb);
    rounded_sum = _mm512_add_ps(rounded_sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wa, 16)),
                                                           _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16))));
    return _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16));
}

// acc[r] = acc[r] * alpha[r] + sum_j p_rj v_j for R rows, from the block's pairs (pP [8][pstride], vP [8][HD]).
template <int HD, int R>
inline void tile_pv_bf16(const uint32_t* pP, int64_t pstride, const float* alpha, const uint32_t* vP, float* acc) {
    constexpr int C = HD / 16;
    __m512 o[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * HD + 16 * c), al);
    }
    for (int jp = 0; jp < 8; ++jp) {
        __m512bh pb[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pb[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pP[jp * pstride + r]));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(vP + jp * HD + 16 * c);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], v, pb[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * HD + 16 * c, o[r][c]);
}

// s[j] lane r = q_r . k_j (unscaled) for sixteen rows (qP: [HD / 2][mp] pairs, this vector's lanes at qP) and the
// block's 16 key rows (kb, kstride elements apart), each key's pairs broadcast from where they are stored.
template <int HD>
inline void scores_by_key_bf16(const uint32_t* qP, int64_t mp, const uint16_t* kb, int64_t kstride, __m512* s) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int dp = 0; dp < HD / 2; ++dp) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qP + dp * mp);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            uint32_t pair;
            std::memcpy(&pair, kb + j * kstride + 2 * dp, sizeof pair);
            s[j] = _mm512_dpbf16_ps(s[j], q, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
        }
    }
}

template <int HD>
void prefill_tile_bf16(const Args& a, const Item& it, float* buf) {
    constexpr int64_t BS = 16, RP = 384 / HD;
    const TileShape t = tile_shape(a, it);
    const int64_t G = t.G, M = t.M, MP = t.MP, h = it.h0;

    // prefill_tile's layout, the pairs in the places of its float32 arrays (each half their size or less)
    uint32_t* qP = reinterpret_cast<uint32_t*>(buf);  // [HD / 2][MP] query pairs (padding rows 0)
    float* acc = buf + HD * MP;                      // [MP][HD]
    float* mrow = acc + MP * HD;                     // [MP] running maximum (base 2)
    float* lrow = mrow + MP;                         // [MP] running sum of the rounded probabilities
    float* alpha = lrow + MP;                        // [MP]
    int32_t* hz = reinterpret_cast<int32_t*>(alpha + MP);  // [MP] keys each row sees (padding: the first row's)
    uint32_t* pP = reinterpret_cast<uint32_t*>(alpha + 2 * MP);  // [8][MP] probability pairs, key-pair-major
    uint32_t* vP = reinterpret_cast<uint32_t*>(alpha + 2 * MP + BS * MP + BS * HD);  // [8][HD] V pairs

    const uint16_t* qbase = static_cast<const uint16_t*>(a.q);
    for (int64_t m = 0; m < MP; ++m) {
        if (m < M) {
            const uint16_t* src = qbase + (t.q0 + m / G) * a.q_st + (h * G + m % G) * a.q_sh;
            for (int64_t dp = 0; dp < HD / 2; ++dp) std::memcpy(qP + dp * MP + m, src + 2 * dp, sizeof(uint32_t));
        } else {
            for (int64_t dp = 0; dp < HD / 2; ++dp) qP[dp * MP + m] = 0;
        }
    }
    tile_start(t, HD, hz, mrow, lrow, acc);

    const uint16_t* kc = static_cast<const uint16_t*>(a.k);
    const uint16_t* vc = static_cast<const uint16_t*>(a.v);
    const int64_t nblocks = (t.max_hz + BS - 1) / BS;
    const __m512 qs = _mm512_set1_ps(a.scale * 1.44269504088896341f);
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = b * BS;
        const int64_t nkeys = t.max_hz - start < BS ? t.max_hz - start : BS;
        if (b + 1 < nblocks) {
            const int64_t next_keys = t.max_hz - start - BS < BS ? t.max_hz - start - BS : BS;
            prefetch_block<uint16_t>(kc, vc, static_cast<int64_t>(t.table[b + 1]) * a.kv_sb + h * a.kv_sh, next_keys, a.kv_st, HD);
        }
        const int64_t off = static_cast<int64_t>(t.table[b]) * a.kv_sb + h * a.kv_sh;
        for (int64_t jp = 0; jp < 8; ++jp) {  // V rows 2jp and 2jp + 1 interleaved; keys past nkeys as zeros
            const __mmask16 l0 = 2 * jp < nkeys ? 0xffff : 0, l1 = 2 * jp + 1 < nkeys ? 0xffff : 0;
            const uint16_t* r0 = vc + off + 2 * jp * a.kv_st;
            const uint16_t* r1 = r0 + a.kv_st;
            for (int64_t c = 0; c < HD; c += 16) {
                const __m512i w0 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(l0, r0 + c));
                const __m512i w1 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(l1, r1 + c));
                _mm512_storeu_si512(vP + jp * HD + c, _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
            }
        }
        // token ti sees keys < first_hz + ti: the rows before m0 see none of this block
        const int64_t m0 = (start >= t.first_hz ? start - t.first_hz + 1 : 0) * G;
        const int64_t v0 = m0 / 16 * 16;
        for (int64_t m = v0; m < MP; m += 16) {
            __m512 s[16];
            scores_by_key_bf16<HD>(qP + m, MP, kc + off, a.kv_st, s);
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) s[j] = _mm512_mul_ps(s[j], qs);
            const __m512 mnew = tile_max16(s, hz + m, start, mrow + m, alpha + m);
            __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int jp = 0; jp < 8; ++jp) {
                const __m512 e0 = exp2_nonpos16(_mm512_sub_ps(s[2 * jp], mnew));
                const __m512 e1 = exp2_nonpos16(_mm512_sub_ps(s[2 * jp + 1], mnew));
                _mm512_storeu_si512(pP + jp * MP + m, bf16_pairs(e0, e1, sum));
            }
            _mm512_storeu_ps(lrow + m, _mm512_fmadd_ps(_mm512_loadu_ps(lrow + m), _mm512_loadu_ps(alpha + m), sum));
        }
        tile_pv_rows<RP>(v0, M, [&](int64_t m, auto r) { tile_pv_bf16<HD, decltype(r)::value>(pP + m, MP, alpha + m, vP, acc + m * HD); });
    }
    tile_finish<BF16, HD>(a, it, t, acc, lrow);
}
#endif

// HD > 0: the head size as a compile-time constant (the common sizes get fully unrolled inner loops);
// HD == 0: any head size, read from the arguments.  Rows are m = (token * nh + head) * G + g.
template <int DT, int HD>
void attend_item(const Args& a, const Item& it, const Item* next, float* buf) {
    using E = Elem<DT>;
    using T = typename E::T;
#if defined(__AVX512F__)
    if constexpr (has_decode_path<DT, HD>()) {
        if (it.count == 1 && a.block_size == 16 && a.soft_cap == 0.0f && a.kv_type == KV_SAME &&
            a.num_heads <= MAX_DECODE_HEADS) {
            decode_item<DT, HD>(a, it, next, buf);
            return;
        }
    }
    if constexpr (HD == 64 || HD == 128) {
        if (it.count > 1 && it.nh == 1 && a.block_size == 16 && a.window == 0 && a.soft_cap == 0.0f &&
            a.kv_type == KV_SAME) {
#if defined(__AVX512BF16__)
            if constexpr (DT == BF16) {
                prefill_tile_bf16<HD>(a, it, buf);
                return;
            }
#endif
            prefill_tile<DT, HD>(a, it, buf);
            return;
        }
    }
#endif
    const int64_t D = HD > 0 ? HD : a.head_size, BS = a.block_size;
    const int64_t G = a.num_heads / a.num_kv_heads;
    const int64_t nh = it.nh, h0 = it.h0;
    const int64_t M = it.count * nh * G;
    const int64_t q0 = a.qsl[it.req];
    const int64_t qlen = a.qsl[it.req + 1] - q0;
    const int64_t ctx = a.seq_lens[it.req] - qlen;
    const int64_t max_hz = ctx + it.first + it.count;  // keys the tile's last token sees
    const int32_t* table = a.bt + it.req * a.bt_stride;

    float* qf = buf;                 // [M][D] scaled query rows
    float* acc = qf + M * D;         // [M][D]
    float* mrow = acc + M * D;       // [M]
    float* lrow = mrow + M;          // [M]
    float* kf = lrow + M;            // [BS][D] (converted block, half types)
    float* vf = kf + BS * D;         // [BS][D]
    float* s = vf + BS * D;          // [BS]

    const T* qbase = static_cast<const T*>(a.q);
    for (int64_t ti = 0; ti < it.count; ++ti) {
        for (int64_t hh = 0; hh < nh; ++hh) {
            for (int64_t g = 0; g < G; ++g) {
                const T* src = qbase + (q0 + it.first + ti) * a.q_st + ((h0 + hh) * G + g) * a.q_sh;
                float* dst = qf + ((ti * nh + hh) * G + g) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) dst[d] = E::load(src[d]) * a.scale;
            }
        }
    }
    for (int64_t i = 0; i < M * D; ++i) acc[i] = 0.0f;
    for (int64_t m = 0; m < M; ++m) {
        mrow[m] = -INFINITY;
        lrow[m] = 0.0f;
    }

    const T* kc = static_cast<const T*>(a.k);
    const T* vc = static_cast<const T*>(a.v);
    const bool quant = a.kv_type != KV_SAME;  // then strides and offsets count bytes
    const uint8_t* kq = static_cast<const uint8_t*>(a.k);
    const uint8_t* vq = static_cast<const uint8_t*>(a.v);
    const int64_t nblocks = (max_hz + BS - 1) / BS;
    // with a window, the tile's first token sees nothing before min_lo; no row of the tile sees earlier keys
    const int64_t min_lo = a.window > 0 && ctx + it.first + 1 > a.window ? ctx + it.first + 1 - a.window : 0;
    for (int64_t b = min_lo / BS; b < nblocks; ++b) {
        const int64_t start = b * BS;
        const int64_t nkeys = max_hz - start < BS ? max_hz - start : BS;
        if (b + 1 < nblocks) {
            const int64_t next_keys = max_hz - start - BS < BS ? max_hz - start - BS : BS;
            for (int64_t hh = 0; hh < nh; ++hh) {
                const int64_t next = static_cast<int64_t>(table[b + 1]) * a.kv_sb + (h0 + hh) * a.kv_sh;
                if (quant) prefetch_block<uint8_t>(kq, vq, next, next_keys, a.kv_st, D);
                else prefetch_block<T>(kc, vc, next, next_keys, a.kv_st, D);
            }
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
            const int64_t off = static_cast<int64_t>(table[b]) * a.kv_sb + (h0 + hh) * a.kv_sh;
            const float* krows;
            const float* vrows;
            int64_t kstride;
            bool bf16_direct = false;  // a decode's full block in bfloat16: K read as stored, only V converted
#if defined(__AVX512BF16__)
            if constexpr (DT == BF16 && HD > 0 && HD % 32 == 0)
                bf16_direct = !quant && it.count == 1 && nkeys == 16 && a.window == 0 && a.soft_cap == 0.0f;
#endif
            if (quant) {
                for (int64_t j = 0; j < nkeys; ++j) {
                    dequant_row(a.kv_type, kq + off + j * a.kv_st, D, a.k_scale, kf + j * D);
                    dequant_row(a.kv_type, vq + off + j * a.kv_st, D, a.v_scale, vf + j * D);
                }
                krows = kf;
                vrows = vf;
                kstride = D;
            } else if constexpr (DT == F32) {
                krows = kc + off;
                vrows = vc + off;
                kstride = a.kv_st;
            } else {
                for (int64_t j = 0; j < nkeys; ++j) {
                    const T* ks = kc + off + j * a.kv_st;
                    const T* vs = vc + off + j * a.kv_st;
                    float* kd = kf + j * D;
                    float* vd = vf + j * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) vd[d] = E::load(vs[d]);
                    if (bf16_direct) continue;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) kd[d] = E::load(ks[d]);
                }
                krows = kf;
                vrows = vf;
                kstride = D;
            }
#if defined(__AVX512BF16__)
            if constexpr (DT == BF16 && HD > 0 && HD % 32 == 0) {
                if (bf16_direct) {
                    const __m512 scale = _mm512_set1_ps(a.scale);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t m = hh * G + g;
                        const T* qrow = qbase + (q0 + it.first) * a.q_st + ((h0 + hh) * G + g) * a.q_sh;
                        row_block16<HD>(_mm512_mul_ps(scores16_bf16<HD>(qrow, kc + off, a.kv_st), scale), vf, D,
                                        mrow[m], lrow[m], acc + m * D);
                    }
                    continue;
                }
            }
#endif
            for (int64_t ti = 0; ti < it.count; ++ti) {
                const int64_t hz = ctx + it.first + ti + 1;  // this token's keys: positions < hz
                const int64_t n = hz - start < nkeys ? hz - start : nkeys;
                const int64_t lo = a.window > 0 && hz > a.window ? hz - a.window : 0;  // and positions >= lo
                const int64_t j0 = lo > start ? lo - start : 0;
                if (n <= j0) continue;
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t m = (ti * nh + hh) * G + g;
                    row_block<HD>(qf + m * D, krows + j0 * kstride, vrows + j0 * kstride, kstride, n - j0, D, a.soft_cap, s,
                                  mrow[m], lrow[m], acc + m * D);
                }
            }
        }
    }

    T* obase = static_cast<T*>(a.out);
    for (int64_t m = 0; m < M; ++m) {
        const int64_t ti = m / (nh * G), hq = h0 * G + m % (nh * G);
        T* dst = obase + (q0 + it.first + ti) * a.o_st + hq * a.o_sh;
        const float inv = 1.0f / lrow[m];
        const float* ar = acc + m * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = E::store(ar[d] * inv);
    }
}

template <int DT, int HD>
void attend_all(const Args& a, const Item* items, int64_t num_items, int num_threads) {
    const int64_t rows = ((TILE_ROWS > a.num_heads ? TILE_ROWS : a.num_heads) + 15) / 16 * 16;  // (prefill_tile pads to 16)
    // (prefill_tile also keeps 16 probabilities, a factor and a horizon per row)
    const size_t floats = static_cast<size_t>(2 * rows * a.head_size + 20 * rows + 2 * a.block_size * a.head_size + a.block_size + 16);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        float* buf = static_cast<float*>(std::aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64));
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) attend_item<DT, HD>(a, items[w], w + 1 < num_items ? items + w + 1 : nullptr, buf);
        std::free(buf);
    }
}

template <int DT>
void dispatch_head(int64_t head_size, const Args& a, const Item* items, int64_t n, int threads) {
    switch (head_size) {
        case 64: attend_all<DT, 64>(a, items, n, threads); break;
        case 128: attend_all<DT, 128>(a, items, n, threads); break;
        default: attend_all<DT, 0>(a, items, n, threads); break;
    }
}

void dispatch(int dtype, int64_t head_size, const Args& a, const Item* items, int64_t n, int threads) {
    if (dtype == F32) dispatch_head<F32>(head_size, a, items, n, threads);
    else if (dtype == BF16) dispatch_head<BF16>(head_size, a, items, n, threads);
    else dispatch_head<F16>(head_size, a, items, n, threads);
}

}  // namespace

extern "C" {

// Error codes written to err[0] (err[1..3] say where): 0 ok, 1 query_start_loc not non-decreasing or past
// num_tokens (req, start, end), 2 seq_len shorter than the query (req, seq_len, query_len), 3 block table
// too narrow (req, blocks needed, width), 4 block id out of range (req, column, id), 5 bad dtype/shape
// (field, value, 0), 6 out of memory.
int corerun_cpu_attention(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* k, const void* v,
                          int64_t kv_sb, int64_t kv_st, int64_t kv_sh, void* out, int64_t o_st, int64_t o_sh,
                          const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt, int64_t bt_stride,
                          int64_t bt_width, int64_t num_reqs, int64_t num_tokens, int64_t num_blocks,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size, float scale,
                          int64_t window, float soft_cap, int kv_type, float k_scale, float v_scale, int num_threads,
                          int64_t* err) {
    err[0] = err[1] = err[2] = err[3] = 0;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_size <= 0 || head_size > MAX_HEAD_SIZE || block_size <= 0 ||
        window < 0 || soft_cap < 0.0f || kv_type < KV_SAME || kv_type > KV_INT8) {
        err[0] = 5;
        err[1] = head_size;
        return 5;
    }
    const int64_t G = num_heads / num_kv_heads;
    const int64_t tile = TILE_ROWS / G > 1 ? TILE_ROWS / G : 1;
    int64_t num_decodes = 0, num_tiles = 0;
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t s0 = qsl[r], s1 = qsl[r + 1], qlen = s1 - s0, sl = seq_lens[r];
        if (s0 < 0 || s1 < s0 || s1 > num_tokens) {
            err[0] = 1; err[1] = r; err[2] = s0; err[3] = s1;
            return 1;
        }
        if (qlen == 0) continue;
        if (sl < qlen) {
            err[0] = 2; err[1] = r; err[2] = sl; err[3] = qlen;
            return 2;
        }
        const int64_t need = (sl + block_size - 1) / block_size;
        if (need > bt_width) {
            err[0] = 3; err[1] = r; err[2] = need; err[3] = bt_width;
            return 3;
        }
        for (int64_t c = 0; c < need; ++c) {
            const int64_t id = bt[r * bt_stride + c];
            if (id < 0 || id >= num_blocks) {
                err[0] = 4; err[1] = r; err[2] = c; err[3] = id;
                return 4;
            }
        }
        if (qlen == 1) ++num_decodes;
        else num_tiles += (qlen + tile - 1) / tile;
    }
    // A decode reads all its KV heads in one item (each block is then one contiguous read), unless there
    // are too few decodes to keep the threads busy; a prefill tile takes one KV head.
    const bool whole_decodes = num_decodes >= 4 * static_cast<int64_t>(num_threads > 1 ? num_threads : 1);
    const int64_t num_items = num_tiles * num_kv_heads + (whole_decodes ? num_decodes : num_decodes * num_kv_heads);
    if (num_items == 0) return 0;
    Item* items = static_cast<Item*>(std::malloc(sizeof(Item) * num_items));
    if (!items) {
        err[0] = 6;
        return 6;
    }
    // Prefill tiles first, last tiles (longest horizons) first: the dynamic schedule then ends on small items.
    int64_t n = 0;
    for (int64_t r = num_reqs - 1; r >= 0; --r) {
        const int64_t qlen = qsl[r + 1] - qsl[r];
        if (qlen <= 1) continue;
        for (int64_t t = ((qlen - 1) / tile) * tile; t >= 0; t -= tile)
            for (int64_t h = 0; h < num_kv_heads; ++h)
                items[n++] = Item{static_cast<int32_t>(r), static_cast<int32_t>(t),
                                  static_cast<int32_t>(qlen - t < tile ? qlen - t : tile), static_cast<int32_t>(h), 1};
    }
    for (int64_t r = 0; r < num_reqs; ++r) {
        if (qsl[r + 1] - qsl[r] != 1) continue;
        if (whole_decodes)
            items[n++] = Item{static_cast<int32_t>(r), 0, 1, 0, static_cast<int32_t>(num_kv_heads)};
        else
            for (int64_t h = 0; h < num_kv_heads; ++h) items[n++] = Item{static_cast<int32_t>(r), 0, 1, static_cast<int32_t>(h), 1};
    }
    Args a{q, q_st, q_sh, k, v, kv_sb, kv_st, kv_sh, out, o_st, o_sh, qsl, seq_lens, bt, bt_stride,
           num_heads, num_kv_heads, head_size, block_size, scale, window, soft_cap, kv_type, k_scale, v_scale};
    if (dtype != F32 && dtype != BF16 && dtype != F16) {
        err[0] = 5; err[1] = -1; err[2] = dtype;
        std::free(items);
        return 5;
    }
    dispatch(dtype, head_size, a, items, num_items, num_threads);
    std::free(items);
    return 0;
}

// Copies key/value rows [num_tokens, num_kv_heads, head_size] (the cache's dtype, elem_size bytes each)
// to their slots; slot -1 writes nothing.  err: 0 ok, 1 slot out of range (token, slot, num_slots).
int corerun_cpu_write_kv(int64_t elem_size, const void* key, int64_t k_st, int64_t k_sh, const void* value,
                         int64_t v_st, int64_t v_sh, void* k_cache, void* v_cache, int64_t kv_sb, int64_t kv_st,
                         int64_t kv_sh, const int64_t* slots, int64_t num_tokens, int64_t num_kv_heads,
                         int64_t head_size, int64_t block_size, int64_t num_blocks, int64_t* err) {
    err[0] = err[1] = err[2] = err[3] = 0;
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < -1 || slots[t] >= num_slots) {
            err[0] = 1; err[1] = t; err[2] = slots[t]; err[3] = num_slots;
            return 1;
        }
    }
    const size_t row = static_cast<size_t>(head_size * elem_size);
    const char* kb = static_cast<const char*>(key);
    const char* vb = static_cast<const char*>(value);
    char* kc = static_cast<char*>(k_cache);
    char* vc = static_cast<char*>(v_cache);
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t base = (slot / block_size) * kv_sb + (slot % block_size) * kv_st;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            std::memcpy(kc + (base + h * kv_sh) * elem_size, kb + (t * k_st + h * k_sh) * elem_size, row);
            std::memcpy(vc + (base + h * kv_sh) * elem_size, vb + (t * v_st + h * v_sh) * elem_size, row);
        }
    }
    return 0;
}

int corerun_cpu_abi_version(void) { return 4; }

int corerun_cpu_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
