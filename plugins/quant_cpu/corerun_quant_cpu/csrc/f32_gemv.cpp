// float32 activations times float32 weights on CPU for a few tokens (a decode step), float32 sums.
//
// Ops (registered in the torch.ops.corerun_quant_cpu library with gguf_gemv.cpp's; see kernels.py):
//   f32_gemv(out, packed, x, isa)
//     packed  float32 [ceil(rows / 16), cols * 16], contiguous: the weight W [rows, cols] repacked
//             (kernels.repack_f32): 16 rows at a time, column by column, so that
//             packed[b, i * 16 + r] = W[16 b + r, i]; rows past the last are zeros.  A row block is one
//             sequential stream of 64-byte vectors, each one column of 16 rows.
//     x       float32 [T, cols], contiguous
//     out     float32 [T, rows], last dimension contiguous (a column slice of a wider output is fine):
//             out[t, j] = sum_i x[t, i] * W[j, i]
//     isa     0 = scalar, 1 = AVX-512 F (one FMA per column and token into 16 row sums; no horizontal
//             sums); refused where the CPU lacks it
//   f32_repack(packed, w)   w float32 [rows, cols] contiguous -> packed as above (once, at load)
//   f32_isa() -> the best isa this CPU runs.
//
// oneDNN's and MKL's one-row float32 products read a [rows, cols] weight row by row and end every row
// with a horizontal sum; on an AMD EPYC (Zen 4) neither used a second thread to any gain (one request:
// 35.8 ms a token on two threads against 33.8 on one, benchmarks/RESULTS.md).  Here every thread streams
// whole row blocks of its own.
//
// Tokens go in tiles of up to 8, each tile one pass over the weights; one token alone goes through four
// row blocks at a time, each from its own quarter of the range (four streams from memory in flight); row
// blocks are split over at::parallel_for (torch's thread pool and OpenMP runtime).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "cpu_features.h"
#include "row_streams.h"

namespace {

enum F32Isa : int64_t { F32_SCALAR = 0, F32_AVX512 = 1 };
constexpr int64_t F32_TILE = 8;  // tokens per pass over the weights
// bytes ahead in a row block's stream for tiles of tokens (bf16_gemv.cpp's measure); one token through four
// streams goes without, as in bf16_gemv.cpp (the default model's products in a replayed step: 0.89-0.98x the time)
constexpr int64_t F32_PREFETCH = 2048;

struct F32Problem {
    const float* w;  // packed
    const float* x;  // [T, cols]
    float* out;
    int64_t cols, rows, T, out_stride;
};

void f32_blocks_scalar(const F32Problem& p, int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
        const float* wb = p.w + b * p.cols * 16;
        const int64_t n = std::min<int64_t>(16, p.rows - b * 16);
        for (int64_t t = 0; t < p.T; ++t) {
            float sums[16] = {0};
            const float* xt = p.x + t * p.cols;
            for (int64_t i = 0; i < p.cols; ++i) {
                const float* v = wb + i * 16;
                for (int r = 0; r < 16; ++r) sums[r] += v[r] * xt[i];
            }
            std::memcpy(p.out + t * p.out_stride + b * 16, sums, static_cast<size_t>(n) * 4);
        }
    }
}

#define F32_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

F32_AVX512_FN inline void f32_store(const F32Problem& p, __m512 s, int64_t t, int64_t j0) {
    const int64_t n = std::min<int64_t>(16, p.rows - j0);
    float* o = p.out + t * p.out_stride + j0;
    if (n == 16) _mm512_storeu_ps(o, s);
    else _mm512_mask_storeu_ps(o, static_cast<__mmask16>((1u << n) - 1), s);
}

// NT tokens through one row block: one FMA per column and token.
template <int NT>
F32_AVX512_FN void f32_block(const F32Problem& p, const float* wb, int64_t t0, int64_t j0) {
    __m512 acc[NT];
    for (int k = 0; k < NT; ++k) acc[k] = _mm512_setzero_ps();
    const float* xt = p.x + t0 * p.cols;
    for (int64_t i = 0; i < p.cols; ++i) {
        const float* v = wb + i * 16;
        _mm_prefetch(reinterpret_cast<const char*>(v) + F32_PREFETCH, _MM_HINT_T0);
        const __m512 w = _mm512_loadu_ps(v);
        for (int k = 0; k < NT; ++k) acc[k] = _mm512_fmadd_ps(w, _mm512_set1_ps(xt[k * p.cols + i]), acc[k]);
    }
    for (int k = 0; k < NT; ++k) f32_store(p, acc[k], t0 + k, j0);
}

// One token, NB row blocks side by side (blk[k], anywhere in the weight), two sums each over alternate columns
// (FMA's latency): NB streams from memory in flight, no software prefetch (see F32_PREFETCH).
template <int NB>
F32_AVX512_FN void f32_blocks_one_token(const F32Problem& p, const int64_t* blk) {
    const float* w[NB];
    __m512 a0[NB], a1[NB];
    for (int k = 0; k < NB; ++k) {
        w[k] = p.w + blk[k] * p.cols * 16;
        a0[k] = a1[k] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 2 <= p.cols; i += 2) {
        const __m512 x0 = _mm512_set1_ps(p.x[i]), x1 = _mm512_set1_ps(p.x[i + 1]);
        for (int k = 0; k < NB; ++k) {
            const float* v = w[k] + i * 16;
            a0[k] = _mm512_fmadd_ps(_mm512_loadu_ps(v), x0, a0[k]);
            a1[k] = _mm512_fmadd_ps(_mm512_loadu_ps(v + 16), x1, a1[k]);
        }
    }
    if (i < p.cols) {
        const __m512 x0 = _mm512_set1_ps(p.x[i]);
        for (int k = 0; k < NB; ++k) a0[k] = _mm512_fmadd_ps(_mm512_loadu_ps(w[k] + i * 16), x0, a0[k]);
    }
    for (int k = 0; k < NB; ++k) f32_store(p, _mm512_add_ps(a0[k], a1[k]), 0, blk[k] * 16);
}

// One token: the range's row blocks in corerun_cpu::ONE_TOKEN_STREAMS streams (row_streams.h, with what it gained).
F32_AVX512_FN int64_t f32_one_token_streams(const F32Problem& p, int64_t begin, int64_t end) {
    constexpr int S = corerun_cpu::ONE_TOKEN_STREAMS;
    return corerun_cpu::row_block_streams<S>(begin, end, [&](const int64_t* blk) { f32_blocks_one_token<S>(p, blk); });
}

F32_AVX512_FN void f32_blocks_avx512(const F32Problem& p, int64_t begin, int64_t end) {
    int64_t b = begin;
    if (p.T == 1) b = f32_one_token_streams(p, begin, end);
    for (; b < end; ++b) {
        const float* wb = p.w + b * p.cols * 16;
        for (int64_t t0 = 0; t0 < p.T; t0 += F32_TILE) {
            switch (std::min<int64_t>(F32_TILE, p.T - t0)) {
                case 1: f32_block<1>(p, wb, t0, b * 16); break;
                case 2: f32_block<2>(p, wb, t0, b * 16); break;
                case 3: f32_block<3>(p, wb, t0, b * 16); break;
                case 4: f32_block<4>(p, wb, t0, b * 16); break;
                case 5: f32_block<5>(p, wb, t0, b * 16); break;
                case 6: f32_block<6>(p, wb, t0, b * 16); break;
                case 7: f32_block<7>(p, wb, t0, b * 16); break;
                default: f32_block<8>(p, wb, t0, b * 16); break;
            }
        }
    }
}

int64_t f32_isa() { return corerun_cpu::has_avx512() ? F32_AVX512 : F32_SCALAR; }

void f32_gemv(at::Tensor out, const at::Tensor& packed, const at::Tensor& x, int64_t isa) {
    TORCH_CHECK(isa >= F32_SCALAR && isa <= f32_isa(), "f32_gemv: isa ", isa, " is not available on this CPU (best: ", f32_isa(), ")");
    TORCH_CHECK(packed.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu(), "f32_gemv: CPU tensors only");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "f32_gemv: x must be contiguous float32 [T, cols], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), rows = out.size(1);
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.stride(1) == 1,
                "f32_gemv: out must be float32 [", T, ", rows] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == (rows + 15) / 16 &&
                    packed.size(1) == cols * 16,
                "f32_gemv: packed must be contiguous float32 [", (rows + 15) / 16, ", ", cols * 16, "] (repack_f32's, for ", rows,
                " rows of ", cols, " columns), got ", packed.scalar_type(), " ", packed.sizes());
    if (T == 0 || rows == 0) return;
    const F32Problem p{packed.data_ptr<float>(), x.data_ptr<float>(), out.data_ptr<float>(), cols, rows, T, out.stride(0)};
    const int64_t blocks = (rows + 15) / 16;
    // about 256 KiB of weights per task (one token: each task's range in row_streams.h's streams, any length)
    const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, cols * 64));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        if (isa == F32_AVX512) f32_blocks_avx512(p, begin, end);
        else f32_blocks_scalar(p, begin, end);
    });
}

void f32_repack(at::Tensor packed, const at::Tensor& w) {
    TORCH_CHECK(w.device().is_cpu() && packed.device().is_cpu(), "f32_repack: CPU tensors only");
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(), "f32_repack: w must be contiguous float32 [rows, cols], got ", w.scalar_type(), " ", w.sizes());
    const int64_t rows = w.size(0), cols = w.size(1), blocks = (rows + 15) / 16;
    TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == blocks && packed.size(1) == cols * 16,
                "f32_repack: packed must be contiguous float32 [", blocks, ", ", cols * 16, "], got ", packed.scalar_type(), " ", packed.sizes());
    const float* src = w.data_ptr<float>();
    float* dst = packed.data_ptr<float>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            float* d = dst + b * cols * 16;
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t row = 16 * b + r;
                for (int64_t i = 0; i < cols; ++i) d[i * 16 + r] = row < rows ? src[row * cols + i] : 0.0f;
            }
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corerun_quant_cpu, m) {
    m.def("f32_gemv(Tensor(a!) out, Tensor packed, Tensor x, int isa) -> ()");
    m.def("f32_repack(Tensor(a!) packed, Tensor w) -> ()");
    m.def("f32_isa() -> int", f32_isa);
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) {
    m.impl("f32_gemv", f32_gemv);
    m.impl("f32_repack", f32_repack);
}
