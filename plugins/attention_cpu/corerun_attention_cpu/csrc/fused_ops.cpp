// Fused elementwise ops on CPU: RMSNorm, SiLU-and-mul and the rotary embedding ("rotate half" layout).
//
// Each op reads its input once (a row is read again only from L1), computes in float32 and rounds the
// result once to the input's dtype; the output is a new contiguous tensor.  Rows may be strided, the
// last dimension is contiguous.  OpenMP over rows from PARALLEL_MIN_ELEMS values on: below that the
// fork costs more than it saves (a decode step's single row stays on the calling thread).
//
// C ABI (called through ctypes; fused_ops.py checks shapes and strides, strides count elements):
//   corerun_cpu_rms_norm      x rows at i * s0 + j * s1 (i < n0, j < n1), hidden values each; weight [hidden];
//                             out [n0 * n1, hidden]: x / sqrt(mean(x^2) + eps) * weight
//   corerun_cpu_silu_and_mul  x [T, 2I] rows at t * x_st; out [T, I]: silu(x[:, :I]) * x[:, I:]
//   corerun_cpu_rotary        x [T, H, D] at t * x_st + h * x_sh; cos, sin float32 [T, D] contiguous;
//                             out [T, H, D]: x * cos + [x2 | x1] * sin for x = [x1 | x2]
// dtype: 0 float32, 1 bfloat16 (the numbering of paged_attention.cpp).  Each returns 0, or 5 for a dtype
// or shape it does not take.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PARALLEL_MIN_ELEMS = 32768;  // about 10 us of work on one core

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

// e^x for x <= 0, branch-free so that the loops calling it vectorise: x = n ln2 + r with |r| <= ln2 / 2,
// e^r from its Taylor series to r^7 (relative error below 1e-8 before rounding), 2^n put in the exponent
// bits; 0 below -87 (where e^x leaves the normal floats).
inline float exp_nonpositive(float x) {
    const float xc = x > -87.0f ? x : -87.0f;
    const float n = std::nearbyint(xc * 1.44269504088896341f);
    const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-6f;  // ln2 split in two
    float e = 1.0f;
    e = 1.0f + r * e * (1.0f / 7.0f);
    e = 1.0f + r * e * (1.0f / 6.0f);
    e = 1.0f + r * e * (1.0f / 5.0f);
    e = 1.0f + r * e * (1.0f / 4.0f);
    e = 1.0f + r * e * (1.0f / 3.0f);
    e = 1.0f + r * e * 0.5f;
    e = 1.0f + r * e;
    const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &exponent, 4);
    return x > -87.0f ? e * two_n : 0.0f;
}

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
void silu_and_mul(const void* xv, int64_t tokens, int64_t x_st, int64_t inter, void* outv, int threads) {
    using T = typename E::T;
    const T* x = static_cast<const T*>(xv);
    T* out = static_cast<T*>(outv);
    for_rows(tokens, tokens * inter, threads, [&](int64_t t) {
        const T* gate = x + t * x_st;
        const T* up = gate + inter;
        T* dst = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
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
    for_rows(tokens * heads, tokens * heads * dim, threads, [&](int64_t r) {
        const int64_t t = r / heads;
        const T* src = x + t * x_st + (r % heads) * x_sh;
        const float* c = cos + t * dim;
        const float* s = sin + t * dim;
        T* dst = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = E::load(src[i]), x2 = E::load(src[half + i]);
            dst[i] = E::store(x1 * c[i] + x2 * s[i]);
            dst[half + i] = E::store(x2 * c[half + i] + x1 * s[half + i]);
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
