// W8A8 on AMX: int8 weights (one scale per output row) times int8 activations quantized per token, as
// corerun.quantization.int8_matmul defines them, for a decode step's few tokens and a prefill's many.
//
// Ops (registered in the torch.ops.corerun_quant_cpu library with the other sources'; see kernels.py):
//   int8_repack(packed, w)   w int8 [rows, cols] contiguous, cols a multiple of 64 -> packed int8
//             [ceil(rows / 16), cols * 16]: 16 rows at a time, their columns in fours, so that
//             packed[b, (q * 16 + r) * 4 + c] = W[16 b + r, 4 q + c]; rows past the last are zeros.  16
//             consecutive 64-byte vectors of a row block (64 columns of 16 rows) are one AMX B tile.
//   int8_amx_linear(out, packed, w_scale, x)
//     x        float32 or bfloat16 [T, cols], contiguous
//     w_scale  float32 [rows], the weight rows' scales
//     out      [T, rows] of x's dtype, last dimension contiguous:
//              s_t = max(max_i |x[t, i]| / 127, FLT_MIN); q[t, i] = clamp(rne(x[t, i] / s_t), -127, 127);
//              out[t, j] = round(float(sum_i q[t, i] W[j, i]) * w_scale[j] * s_t)
//              (the sum exact in int32; the scales applied in float32, in that order, as int8_matmul does)
//   int8_amx_available() -> whether this CPU has AMX-TILE and AMX-INT8 and Linux grants the tile state.
//
// The product: TDPBSSD multiplies 16 tokens x 64 columns (A, int8) by 64 columns x 16 rows (B) into 16 x 16
// int32 sums, in amx_tiles.h's loops; row blocks (and, for many tokens, token chunks) are split over
// at::parallel_for (torch's thread pool and OpenMP runtime), and so are the tokens' quantization past about
// 64 KiB of activations.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>

#include "amx_tiles.h"
#include "w8a8_quantize.h"

namespace {

#define INT8_AMX_FN CORERUN_AMX_FN

struct Int8Tiles {
    const float* xs;  // activation scales [T]
    const float* ws;  // weight scales [rows]
    void* out;
    bool bf16_out;
    int64_t rows, T, out_stride;

    static constexpr corerun_amx::Op op = corerun_amx::Op::int8;
    static constexpr bool overlap_store = false;  // the overlapped store was 2-8% slower here (256-4096 tokens)

    // c: [mt][2][16 tokens][16 rows] int32 sums -> float(acc) * w_scale * x_scale in out's dtype, tokens t < T only
    CORERUN_AMX_FN void store(const int32_t* c, int mt, int nb, int64_t m0, int64_t b) const {
        for (int mi = 0; mi < mt; ++mi) {
            for (int ni = 0; ni < nb; ++ni) {
                const int64_t j = (b + ni) * 16, n = std::min<int64_t>(16, rows - j);
                const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
                const __m512 w = _mm512_maskz_loadu_ps(mask, ws + j);
                const int32_t* tile = c + (mi * 2 + ni) * 256;
                for (int r = 0; r < 16 && m0 + mi * 16 + r < T; ++r) {
                    const int64_t t = m0 + mi * 16 + r;
                    const __m512 acc = _mm512_cvtepi32_ps(_mm512_loadu_si512(tile + r * 16));
                    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(acc, w), _mm512_set1_ps(xs[t]));
                    if (bf16_out) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + t * out_stride + j, mask, (__m256i)_mm512_cvtneps_pbh(y));
                    else _mm512_mask_storeu_ps(static_cast<float*>(out) + t * out_stride + j, mask, y);
                }
            }
        }
    }
};

bool int8_amx_available() { return corerun_amx::available(25); }

// amx_tiles.h's tunables for many tokens (both ops'): each value >= 0 replaces the current one; returns the
// values before, [large_tokens, group_bytes, chunk_tokens, order] (benchmarks and tests).
std::vector<int64_t> amx_tuning(std::vector<int64_t> values) {
    corerun_amx::Tuning& t = corerun_amx::tuning();
    std::vector<int64_t> before{t.large_tokens, t.group_bytes, t.chunk_tokens, t.order};
    int64_t* fields[] = {&t.large_tokens, &t.group_bytes, &t.chunk_tokens, &t.order};
    TORCH_CHECK(values.size() <= 4, "amx_tuning: at most 4 values, got ", values.size());
    for (size_t i = 0; i < values.size(); ++i)
        if (values[i] >= 0) *fields[i] = values[i];
    return before;
}

void int8_amx_linear(at::Tensor out, const at::Tensor& packed, const at::Tensor& w_scale, const at::Tensor& x) {
    TORCH_CHECK(int8_amx_available(), "int8_amx_linear: this CPU (or kernel) offers no AMX-INT8");
    corerun_w8a8::check_linear("int8_amx_linear", out, packed, w_scale, x);
    const int64_t T = x.size(0), cols = x.size(1), rows = out.size(1);
    if (T == 0 || rows == 0) return;
    const int64_t Tpad = (T + 15) / 16 * 16;
    const corerun_w8a8::Codes q = corerun_w8a8::quantize_tokens<false>(x, Tpad);
    int8_t* codes = q.codes;
    const float* xs = q.scales;
    const Int8Tiles kernel{xs, w_scale.data_ptr<float>(), out.data_ptr(), x.scalar_type() == at::kBFloat16, rows, T, out.stride(0)};
    const corerun_amx::Operands o{reinterpret_cast<const char*>(packed.data_ptr<int8_t>()), reinterpret_cast<const char*>(codes),
                                  cols, cols, cols * 16, Tpad};
    const int64_t blocks = (rows + 15) / 16;
    corerun_amx::product(kernel, o, blocks);
}

void int8_repack(at::Tensor packed, const at::Tensor& w) {
    TORCH_CHECK(w.device().is_cpu() && packed.device().is_cpu(), "int8_repack: CPU tensors only");
    TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "int8_repack: w must be contiguous int8 [rows, cols], got ", w.scalar_type(), " ", w.sizes());
    const int64_t rows = w.size(0), cols = w.size(1), blocks = (rows + 15) / 16;
    TORCH_CHECK(cols % 64 == 0, "int8_repack: columns must be a multiple of 64, got ", cols);
    TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == blocks && packed.size(1) == cols * 16,
                "int8_repack: packed must be contiguous int8 [", blocks, ", ", cols * 16, "], got ", packed.scalar_type(), " ", packed.sizes());
    const int8_t* src = w.data_ptr<int8_t>();
    int8_t* dst = packed.data_ptr<int8_t>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            int8_t* d = dst + b * cols * 16;
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t row = 16 * b + r;
                for (int64_t i = 0; i < cols; ++i) d[((i / 4) * 16 + r) * 4 + (i & 3)] = row < rows ? src[row * cols + i] : 0;
            }
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corerun_quant_cpu, m) {
    m.def("int8_amx_linear(Tensor(a!) out, Tensor packed, Tensor w_scale, Tensor x) -> ()");
    m.def("int8_repack(Tensor(a!) packed, Tensor w) -> ()");
    m.def("int8_amx_available() -> bool", int8_amx_available);
    m.def("amx_tuning(int[] values) -> int[]", amx_tuning);
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) {
    m.impl("int8_amx_linear", int8_amx_linear);
    m.impl("int8_repack", int8_repack);
}
