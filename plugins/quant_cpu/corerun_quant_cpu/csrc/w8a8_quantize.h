// W8A8's per-token activation quantization, shared by int8_amx.cpp (signed codes for TDPBSSD) and
// int8_vnni.cpp (codes + 128, unsigned, for VPDPBUSD), as corerun.quantization.int8_matmul defines it:
//   s_t = max(max_i |x[t, i]| / 127, FLT_MIN);  q[t, i] = clamp(rne(x[t, i] / s_t), -127, 127)
// the division in float32 (not a multiplication by the reciprocal), rounded to nearest even.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>

namespace corerun_w8a8 {

// AVX-512 F/BW/VL only: a subset of both kernels' targets, so that it inlines into either
#define CORERUN_W8A8_QFN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

CORERUN_W8A8_QFN inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
CORERUN_W8A8_QFN inline __m512 load16(const c10::BFloat16* x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// One token's codes and scale; cols a multiple of 16.  Offset: each code + 128, stored as its unsigned byte.
template <typename T, bool Offset>
CORERUN_W8A8_QFN void quantize_row(const T* x, int64_t cols, int8_t* q, float* scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < cols; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + i)));
    const float s = std::max(_mm512_reduce_max_ps(amax) / 127.f, FLT_MIN);
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    for (int64_t i = 0; i < cols; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
        const __m128i bytes = Offset ? _mm512_cvtusepi32_epi8(_mm512_add_epi32(c, _mm512_set1_epi32(128))) : _mm512_cvtsepi32_epi8(c);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), bytes);
    }
    *scale = s;
}

struct Codes {
    int8_t* codes;  // [rows, cols]: the T tokens' codes, then zeros up to rows
    float* scales;  // [T]
};

// Every token of x (float32 or bfloat16 [T, cols], contiguous) quantized into this thread's buffers (kept
// between calls: a decode step makes many), padded with zero codes to `rows` >= T rows; over tokens on
// torch's threads past about 64 KiB of activations (below, waking the pool would cost more than it saves).
template <bool Offset>
Codes quantize_tokens(const at::Tensor& x, int64_t rows) {
    const int64_t T = x.size(0), cols = x.size(1);
    thread_local std::vector<int8_t> code_buffer;
    thread_local std::vector<float> scale_buffer;
    if (code_buffer.size() < static_cast<size_t>(rows * cols)) code_buffer.resize(static_cast<size_t>(rows * cols));
    if (scale_buffer.size() < static_cast<size_t>(T)) scale_buffer.resize(static_cast<size_t>(T));
    int8_t* codes = code_buffer.data();
    std::memset(codes + T * cols, 0, static_cast<size_t>((rows - T) * cols));
    float* xs = scale_buffer.data();
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (cols * static_cast<int64_t>(x.element_size())));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            if (x.scalar_type() == at::kFloat) quantize_row<float, Offset>(x.data_ptr<float>() + t * cols, cols, codes + t * cols, &xs[t]);
            else quantize_row<c10::BFloat16, Offset>(x.data_ptr<at::BFloat16>() + t * cols, cols, codes + t * cols, &xs[t]);
        }
    });
    return {codes, xs};
}

// The operands both linear ops take (see their sources), checked; `op` names the caller in the messages.
inline void check_linear(const char* op, const at::Tensor& out, const at::Tensor& packed, const at::Tensor& w_scale, const at::Tensor& x) {
    TORCH_CHECK(packed.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu() && w_scale.device().is_cpu(), op, ": CPU tensors only");
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
                op, ": x must be contiguous float32 or bfloat16 [T, cols], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), rows = out.size(1);
    TORCH_CHECK(cols > 0 && cols % 64 == 0, op, ": columns must be a positive multiple of 64 (the repacked layout's blocks), got ", cols);
    TORCH_CHECK(cols <= 65536, op, ": at most 65536 columns (int32 sums of 255 x 128 per column), got ", cols);
    TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == T && out.stride(1) == 1,
                op, ": out must be [", T, ", rows] of x's dtype with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == (rows + 15) / 16 &&
                    packed.size(1) == cols * 16,
                op, ": packed must be contiguous int8 [", (rows + 15) / 16, ", ", cols * 16, "] (int8_repack's, for ", rows,
                " rows of ", cols, " columns), got ", packed.scalar_type(), " ", packed.sizes());
    TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == rows,
                op, ": w_scale must be contiguous float32 with ", rows, " values, got ", w_scale.scalar_type(), " ", w_scale.sizes());
}

}  // namespace corerun_w8a8
