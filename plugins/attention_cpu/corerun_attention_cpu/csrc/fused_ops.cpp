// Fused elementwise ops on CPU: RMSNorm (alone and after the residual add), SiLU-and-mul and the rotary
// embedding ("rotate half" layout).
//
// Each op reads its input once (a row is read again only from L1), computes in float32 and rounds the
// result once to the input's dtype; the output is a new contiguous tensor.  Rows may be strided, the
// last dimension is contiguous.  OpenMP over rows from PARALLEL_MIN_ELEMS values on: below that the
// fork costs more than it saves (a decode step's single row stays on the calling thread).  The loops are
// left to the compiler's vectorisation, except SiLU-and-mul's, written in AVX-512 where the CPU has it.
//
// C ABI (called through ctypes; fused_ops.py checks shapes and strides, strides count elements):
//   corerun_cpu_rms_norm      x rows at i * s0 + j * s1 (i < n0, j < n1), hidden values each; weight [hidden];
//                             out [n0 * n1, hidden]: x / sqrt(mean(x^2) + eps) * weight
//   corerun_cpu_add_rms_norm  x [T, hidden] rows at t * x_st, residual rows at t * r_st; weight [hidden];
//                             new_residual [T, hidden] = x + residual (rounded once), out [T, hidden] =
//                             new_residual / sqrt(mean(new_residual^2) + eps) * weight (from the rounded sum,
//                             as the add and the norm one after the other give it)
//   corerun_cpu_silu_and_mul  x [T, 2I] rows at t * x_st; out [T, I]: silu(x[:, :I]) * x[:, I:]
//   corerun_cpu_rotary        x [T, H, D] at t * x_st + h * x_sh; cos, sin float32 [T, D] contiguous;
//                             out [T, H, D]: x * cos + [x2 | x1] * sin for x = [x1 | x2]
// dtype: 0 float32, 1 bfloat16 (the numbering of paged_attention.cpp).  Each returns 0, or 5 for a dtype
// or shape it does not take.
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PARALLEL_MIN_ELEMS = 32768;  // torch's at::internal::GRAIN_SIZE, the same trade-off

struct Float32 {
    using T = float;
    static inline float load(float v) { return v; }
    static inline float store(float v) { return v; }
};

struct BFloat16 {  // bfloat16 is the top half of a float32
    using T = uint16_t;
    static inline float load(uint16_t v) {
        const uint32_t bits = static_cast<uint32_t>(v) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    static inline uint16_t store(float f) {  // round to nearest even, as torch does; NaN stays a (quiet) NaN
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const uint32_t quiet_nan = (bits >> 16) | 0x40u;
        return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
    }
};

constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693145751953125f, LN2_LO = 1.428606765330187e-6f;
constexpr float EXP_TAYLOR[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};  // r^7 .. r^0

// e^x for x <= 0, branch-free so that the loops calling it vectorise: x = n ln2 + r with |r| <= ln2 / 2,
// e^r from its Taylor series to r^7 (relative error below 1e-8 before rounding), 2^n put in the exponent
// bits; 0 below -87 (where e^x leaves the normal floats).
inline float exp_nonpositive(float x) {
    const float xc = x > -87.0f ? x : -87.0f;
    const float n = std::nearbyint(xc * LOG2E);
    const float r = (xc - n * LN2_HI) - n * LN2_LO;
    float e = EXP_TAYLOR[0];
    for (int k = 1; k < 8; ++k) e = e * r + EXP_TAYLOR[k];
    const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &exponent, 4);
    return x > -87.0f ? e * two_n : 0.0f;
}

#if defined(__AVX512F__)
// SiLU-and-mul 16 lanes at a time (1.7x the compiler's vectorisation of the loop below in bfloat16): the
// same e^x as exp_nonpositive with 2^n applied by scalef, 1 / (1 + e) from the 14-bit reciprocal and one
// Newton step (relative error about 1e-8), bfloat16 widened and rounded in registers as BFloat16 does.
inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc));
    __m512 e = _mm512_set1_ps(EXP_TAYLOR[0]);
    for (int k = 1; k < 8; ++k) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(EXP_TAYLOR[k]));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), e, n);
}
inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(_mm512_mul_ps(g, u), _mm512_mul_ps(num, inv));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
#endif

template <typename Row>
void for_rows(int64_t rows, int64_t elems, int threads, const Row& row) {
#ifdef _OPENMP
    if (threads > 1 && rows > 1 && elems >= PARALLEL_MIN_ELEMS) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < rows; ++r) row(r);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) row(r);
}

template <typename E>
void rms_norm(const void* xv, int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t hidden, const void* wv,
              float eps, void* outv, int threads) {
    using T = typename E::T;
    const T* x = static_cast<const T*>(xv);
    const T* w = static_cast<const T*>(wv);
    T* out = static_cast<T*>(outv);
    const float inv_hidden = 1.0f / static_cast<float>(hidden);
    for_rows(n0 * n1, n0 * n1 * hidden, threads, [&](int64_t r) {
        const T* src = x + (r / n1) * s0 + (r % n1) * s1;
        T* dst = out + r * hidden;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
            const float v = E::load(src[i]);
            squares += v * v;
        }
        const float scale = 1.0f / std::sqrt(squares * inv_hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) dst[i] = E::store(E::load(src[i]) * scale * E::load(w[i]));
    });
}

template <typename E>
void add_rms_norm(const void* xv, int64_t x_st, const void* rv, int64_t r_st, int64_t tokens, int64_t hidden,
                  const void* wv, float eps, void* outv, void* resv, int threads) {
    using T = typename E::T;
    const T* x = static_cast<const T*>(xv);
    const T* res = static_cast<const T*>(rv);
    const T* w = static_cast<const T*>(wv);
    T* out = static_cast<T*>(outv);
    T* new_res = static_cast<T*>(resv);
    const float inv_hidden = 1.0f / static_cast<float>(hidden);
    for_rows(tokens, tokens * hidden, threads, [&](int64_t t) {
        const T* a = x + t * x_st;
        const T* b = res + t * r_st;
        T* sum = new_res + t * hidden;
        T* dst = out + t * hidden;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
            const T s = E::store(E::load(a[i]) + E::load(b[i]));  // the stream as the model's dtype holds it
            sum[i] = s;
            const float v = E::load(s);
            squares += v * v;
        }
        const float scale = 1.0f / std::sqrt(squares * inv_hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) dst[i] = E::store(E::load(sum[i]) * scale * E::load(w[i]));
    });
}

template <typename E>
void silu_and_mul(const void* xv, int64_t tokens, int64_t x_st, int64_t inter, void* outv, int threads) {
    using T = typename E::T;
    const T* x = static_cast<const T*>(xv);
    T* out = static_cast<T*>(outv);
    for_rows(tokens, tokens * inter, threads, [&](int64_t t) {
        const T* gate = x + t * x_st;
        const T* up = gate + inter;
        T* dst = out + t * inter;
        int64_t start = 0;
#if defined(__AVX512F__)
        for (; start + 16 <= inter; start += 16)
            store16(dst + start, silu_mul16(load16(gate + start), load16(up + start)));
#endif
#pragma omp simd
        for (int64_t i = start; i < inter; ++i) {
            const float g = E::load(gate[i]);
            const float e = exp_nonpositive(-std::fabs(g));  // sigmoid(g) = 1 / (1 + e^-g) = e^g / (1 + e^g)
            const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
            dst[i] = E::store(g * sigmoid * E::load(up[i]));
        }
    });
}

template <typename E>
void rotary(const void* xv, int64_t tokens, int64_t heads, int64_t dim, int64_t x_st, int64_t x_sh,
            const float* cos, const float* sin, void* outv, int threads) {
    using T = typename E::T;
    const T* x = static_cast<const T*>(xv);
    T* out = static_cast<T*>(outv);
    const int64_t half = dim / 2;
    // one token's heads per task: a head row is only dim values, and splitting a flat row index into token
    // and head took two integer divisions per row (bfloat16, 32 tokens x 12 heads of 64, one thread, in
    // cache: 10.5 us that way, 8.8 us this way; float32 5.1 and 5.4 us, within the noise)
    for_rows(tokens, tokens * heads * dim, threads, [&](int64_t t) {
        const float* c = cos + t * dim;
        const float* s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const T* src = x + t * x_st + h * x_sh;
            T* dst = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = E::load(src[i]), x2 = E::load(src[half + i]);
                dst[i] = E::store(x1 * c[i] + x2 * s[i]);
                dst[half + i] = E::store(x2 * c[half + i] + x1 * s[half + i]);
            }
        }
    });
}

enum DType { F32 = 0, BF16 = 1 };

}  // namespace

extern "C" {

int corerun_cpu_rms_norm(int dtype, const void* x, int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t hidden,
                         const void* weight, float eps, void* out, int threads) {
    if (n0 < 0 || n1 < 0 || hidden <= 0) return 5;
    if (dtype == F32) rms_norm<Float32>(x, n0, s0, n1, s1, hidden, weight, eps, out, threads);
    else if (dtype == BF16) rms_norm<BFloat16>(x, n0, s0, n1, s1, hidden, weight, eps, out, threads);
    else return 5;
    return 0;
}

int corerun_cpu_add_rms_norm(int dtype, const void* x, int64_t x_st, const void* residual, int64_t r_st, int64_t tokens,
                             int64_t hidden, const void* weight, float eps, void* out, void* new_residual, int threads) {
    if (tokens < 0 || hidden <= 0) return 5;
    if (dtype == F32) add_rms_norm<Float32>(x, x_st, residual, r_st, tokens, hidden, weight, eps, out, new_residual, threads);
    else if (dtype == BF16) add_rms_norm<BFloat16>(x, x_st, residual, r_st, tokens, hidden, weight, eps, out, new_residual, threads);
    else return 5;
    return 0;
}

int corerun_cpu_silu_and_mul(int dtype, const void* x, int64_t tokens, int64_t x_st, int64_t inter, void* out,
                             int threads) {
    if (tokens < 0 || inter <= 0) return 5;
    if (dtype == F32) silu_and_mul<Float32>(x, tokens, x_st, inter, out, threads);
    else if (dtype == BF16) silu_and_mul<BFloat16>(x, tokens, x_st, inter, out, threads);
    else return 5;
    return 0;
}

int corerun_cpu_rotary(int dtype, const void* x, int64_t tokens, int64_t heads, int64_t dim, int64_t x_st,
                       int64_t x_sh, const float* cos, const float* sin, void* out, int threads) {
    if (tokens < 0 || heads < 0 || dim <= 0 || dim % 2) return 5;
    if (dtype == F32) rotary<Float32>(x, tokens, heads, dim, x_st, x_sh, cos, sin, out, threads);
    else if (dtype == BF16) rotary<BFloat16>(x, tokens, heads, dim, x_st, x_sh, cos, sin, out, threads);
    else return 5;
    return 0;
}

}  // extern "C"
