// bfloat16 activations times bfloat16 weights on CPU for a few tokens (a decode step), float32 sums.
//
// Ops (registered in the torch.ops.corerun_quant_cpu library with gguf_gemv.cpp's; see kernels.py):
//   bf16_gemv(out, packed, x, isa)
//     packed  bfloat16 [ceil(rows / 16), ceil(cols / 2) * 32], contiguous: the weight W [rows, cols]
//             repacked (kernels.repack_bf16): 16 rows at a time, their columns in pairs, so that
//             packed[b, (p * 16 + r) * 2 + c] = W[16 b + r, 2 p + c]; rows past the last and a last odd
//             column are zeros.  A row block is one sequential stream of 64-byte vectors, each 16 rows
//             times 2 columns.
//     x       bfloat16 [T, cols], contiguous
//     out     bfloat16 [T, rows], last dimension contiguous (a column slice of a wider output is fine):
//             out[t, j] = bf16(sum_i x[t, i] * W[j, i]), the sum in float32
//     isa     0 = scalar, 1 = AVX-512 F (bfloat16 widened to float32, FMA), 2 = AVX-512 BF16
//             (vdpbf16ps: one instruction multiplies a 16-row x 2-column vector by a broadcast pair
//             of x and adds into 16 float32 row sums; no horizontal sums), 3 = AMX (tiles, below; one
//             token and widths not a multiple of 32 take 2); refused where the CPU lacks it
//   bf16_repack(packed, w)   w bfloat16 [rows, cols] contiguous -> packed as above (once, at load; no temporaries)
//   bf16_isa() -> the best isa this CPU runs.
//
// Tokens go in tiles of up to 8, each tile one pass over the weights (a step of 8 tokens or fewer reads
// them once); one token alone goes through four row blocks at a time, each from its own quarter of the
// range (one_token_dp_blocks); row blocks are split over
// at::parallel_for (torch's thread pool and OpenMP runtime).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>

#include "bf16_round.h"

#include "amx_tiles.h"
#include "cpu_features.h"
#include "row_streams.h"

namespace {

enum Bf16Isa : int64_t { BF_SCALAR = 0, BF_AVX512 = 1, BF_AVX512BF16 = 2, BF_AMX = 3 };
constexpr int64_t TILE = 8;  // tokens per pass over the weights
// Software prefetch, bytes ahead in a row block's stream, each 64-byte line once, for tiles of tokens.
// Streaming the default model's 269 MB of weights (benchmarks/RESULTS.md) took 27-28 ms per token without it,
// 23.7-25 ms at 1024 and 2048 bytes, 26-27 ms at 4096 (one thread, a shared machine, one stream).  One token
// through four streams (blocks_dp_one_token) goes without: there the hardware's prefetchers keep up, and the
// default model's 120 products inside a replayed step took 0.84-0.87x the time without it on one thread of an
// AMD EPYC (Zen 4), 0.77-1.00x on two (RESULTS.md, "Twenty-first session").
constexpr int64_t BF_PREFETCH = 2048;

struct Bf16Problem {
    const uint16_t* w;  // packed
    const uint32_t* xp;  // x as pairs of bfloat16, [T, npairs] (a last odd column paired with 0)
    uint16_t* out;
    int64_t npairs, rows, T, out_stride;
};

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept a NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

void store_row_sums(const Bf16Problem& p, const float* sums, int64_t t, int64_t j0) {
    const int64_t n = std::min<int64_t>(16, p.rows - j0);
    uint16_t* o = p.out + t * p.out_stride + j0;
    for (int64_t r = 0; r < n; ++r) o[r] = float_to_bf16(sums[r]);
}

void blocks_scalar(const Bf16Problem& p, int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
        const uint16_t* wb = p.w + b * p.npairs * 32;
        for (int64_t t = 0; t < p.T; ++t) {
            float sums[16] = {0};
            const uint32_t* xt = p.xp + t * p.npairs;
            for (int64_t q = 0; q < p.npairs; ++q) {
                const float x0 = bf16_to_float(static_cast<uint16_t>(xt[q] & 0xffffu)), x1 = bf16_to_float(static_cast<uint16_t>(xt[q] >> 16));
                const uint16_t* v = wb + q * 32;
                for (int r = 0; r < 16; ++r) sums[r] += bf16_to_float(v[2 * r]) * x0 + bf16_to_float(v[2 * r + 1]) * x1;
            }
            store_row_sums(p, sums, t, b * 16);
        }
    }
}

#define BF16_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define BF16_DP_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

BF16_AVX512_FN inline void store_sums_avx512(const Bf16Problem& p, __m512 s, int64_t t, int64_t j0) {
    const __m256i h = corerun_bf16::round16(s);  // vcvtneps2bf16 is AVX512_BF16's
    const int64_t n = std::min<int64_t>(16, p.rows - j0);
    uint16_t* o = p.out + t * p.out_stride + j0;
    if (n == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
    else _mm256_mask_storeu_epi16(o, static_cast<__mmask16>((1u << n) - 1), h);
}

template <int NT>
BF16_AVX512_FN void block_avx512(const Bf16Problem& p, const uint16_t* wb, int64_t t0, int64_t j0) {
    __m512 acc[NT];
    for (int k = 0; k < NT; ++k) acc[k] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t q = 0; q < p.npairs; ++q) {
        const uint16_t* v = wb + q * 32;
        _mm_prefetch(reinterpret_cast<const char*>(v) + BF_PREFETCH, _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(v);
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), w1 = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
        for (int k = 0; k < NT; ++k) {
            const uint32_t xq = p.xp[(t0 + k) * p.npairs + q];
            acc[k] = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xq << 16))), acc[k]);
            acc[k] = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xq & 0xffff0000u))), acc[k]);
        }
    }
    for (int k = 0; k < NT; ++k) store_sums_avx512(p, acc[k], t0 + k, j0);
}

// Two accumulators per token over alternate column pairs: one token alone would otherwise wait on
// vdpbf16ps's latency at every pair.
template <int NT>
BF16_DP_FN void block_dp(const Bf16Problem& p, const uint16_t* wb, int64_t t0, int64_t j0) {
    __m512 a0[NT], a1[NT];
    for (int k = 0; k < NT; ++k) a0[k] = a1[k] = _mm512_setzero_ps();
    const uint32_t* xt = p.xp + t0 * p.npairs;
    int64_t q = 0;
    for (; q + 2 <= p.npairs; q += 2) {
        const uint16_t* v = wb + q * 32;
        _mm_prefetch(reinterpret_cast<const char*>(v) + BF_PREFETCH, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v) + BF_PREFETCH + 64, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(v), w1 = (__m512bh)_mm512_loadu_si512(v + 32);
        for (int k = 0; k < NT; ++k) {
            a0[k] = _mm512_dpbf16_ps(a0[k], w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[k * p.npairs + q])));
            a1[k] = _mm512_dpbf16_ps(a1[k], w1, (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[k * p.npairs + q + 1])));
        }
    }
    if (q < p.npairs) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + q * 32);
        for (int k = 0; k < NT; ++k)
            a0[k] = _mm512_dpbf16_ps(a0[k], w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[k * p.npairs + q])));
    }
    for (int k = 0; k < NT; ++k) {
        const __m512 s = _mm512_add_ps(a0[k], a1[k]);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(s);
        const int64_t n = std::min<int64_t>(16, p.rows - j0);
        uint16_t* o = p.out + (t0 + k) * p.out_stride + j0;
        if (n == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
        else _mm256_mask_storeu_epi16(o, static_cast<__mmask16>((1u << n) - 1), h);
    }
}

#define BF16_DISPATCH(FN, ATTR)                                                                     \
    ATTR void FN##_blocks(const Bf16Problem& p, int64_t begin, int64_t end) {                       \
        for (int64_t b = begin; b < end; ++b) {                                                     \
            const uint16_t* wb = p.w + b * p.npairs * 32;                                           \
            for (int64_t t0 = 0; t0 < p.T; t0 += TILE) {                                           \
                switch (std::min<int64_t>(TILE, p.T - t0)) {                                        \
                    case 1: FN<1>(p, wb, t0, b * 16); break;                                        \
                    case 2: FN<2>(p, wb, t0, b * 16); break;                                        \
                    case 3: FN<3>(p, wb, t0, b * 16); break;                                        \
                    case 4: FN<4>(p, wb, t0, b * 16); break;                                        \
                    case 5: FN<5>(p, wb, t0, b * 16); break;                                        \
                    case 6: FN<6>(p, wb, t0, b * 16); break;                                        \
                    case 7: FN<7>(p, wb, t0, b * 16); break;                                        \
                    default: FN<8>(p, wb, t0, b * 16); break;                                       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

BF16_DISPATCH(block_avx512, BF16_AVX512_FN)
BF16_DISPATCH(block_dp, BF16_DP_FN)

// One token, NB row blocks side by side (blk[k], anywhere in the weight): NB streams from memory in flight,
// no software prefetch (see BF_PREFETCH).
template <int NB>
BF16_DP_FN void blocks_dp_one_token(const Bf16Problem& p, const int64_t* blk) {
    __m512 a0[NB], a1[NB];
    const uint16_t* w[NB];
    for (int k = 0; k < NB; ++k) {
        a0[k] = a1[k] = _mm512_setzero_ps();
        w[k] = p.w + blk[k] * p.npairs * 32;
    }
    const uint32_t* xt = p.xp;
    int64_t q = 0;
    for (; q + 2 <= p.npairs; q += 2) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[q])), x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[q + 1]));
        for (int k = 0; k < NB; ++k) {
            const uint16_t* v = w[k] + q * 32;
            a0[k] = _mm512_dpbf16_ps(a0[k], (__m512bh)_mm512_loadu_si512(v), x0);
            a1[k] = _mm512_dpbf16_ps(a1[k], (__m512bh)_mm512_loadu_si512(v + 32), x1);
        }
    }
    if (q < p.npairs) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[q]));
        for (int k = 0; k < NB; ++k) a0[k] = _mm512_dpbf16_ps(a0[k], (__m512bh)_mm512_loadu_si512(w[k] + q * 32), x0);
    }
    for (int k = 0; k < NB; ++k) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[k], a1[k]));
        const int64_t j = blk[k] * 16, n = std::min<int64_t>(16, p.rows - j);
        if (n == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + j), h);
        else _mm256_mask_storeu_epi16(p.out + j, static_cast<__mmask16>((1u << n) - 1), h);
    }
}

// The range's row blocks in corerun_cpu::ONE_TOKEN_STREAMS streams (row_streams.h, with what it gained).
BF16_DP_FN void one_token_dp_blocks(const Bf16Problem& p, int64_t begin, int64_t end) {
    constexpr int S = corerun_cpu::ONE_TOKEN_STREAMS;
    const int64_t rest = corerun_cpu::row_block_streams<S>(begin, end, [&](const int64_t* blk) { blocks_dp_one_token<S>(p, blk); });
    for (int64_t b = rest; b < end; ++b) blocks_dp_one_token<1>(p, &b);
}

// AMX (isa 3): TDPBF16PS multiplies 16 tokens x 32 columns (A, bfloat16) by 16 column pairs x 16 rows (B,
// bfloat16 pairs) into 16 tokens x 16 rows (C, float32).  The packed layout above is AMX's B layout as it
// stands: a row block's 16 pairs p0 .. p0 + 15 are 16 consecutive 64-byte vectors, one 1 KiB tile.  The
// loops are amx_tiles.h's; columns must be a multiple of 32 (whole tiles: bf16_gemv sends other shapes to
// AVX512_BF16) and the tokens are padded to a multiple of 16 with zeros.
struct Bf16Tiles {
    uint16_t* out;
    int64_t rows, T, out_stride;

    static constexpr corerun_amx::Op op = corerun_amx::Op::bf16;
    static constexpr bool overlap_store = true;  // 1024 tokens 261 against 280 ms through the model, 256 level

    // c: [mt][2][16 tokens][16 rows] float32 sums -> bfloat16 out, tokens t < T only
    CORERUN_AMX_FN void store(const int32_t* c, int mt, int nb, int64_t m0, int64_t b) const {
        const float* sums = reinterpret_cast<const float*>(c);
        for (int mi = 0; mi < mt; ++mi) {
            for (int ni = 0; ni < nb; ++ni) {
                const int64_t j = (b + ni) * 16, n = std::min<int64_t>(16, rows - j);
                const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
                const float* tile = sums + (mi * 2 + ni) * 256;
                for (int r = 0; r < 16 && m0 + mi * 16 + r < T; ++r) {
                    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tile + r * 16));
                    _mm256_mask_storeu_epi16(out + (m0 + mi * 16 + r) * out_stride + j, mask, h);
                }
            }
        }
    }
};

bool cpu_has_amx_bf16() { return corerun_amx::available(22); }

bool cpu_has_avx512bf16() {
    return corerun_cpu::has_avx512() && __builtin_cpu_supports("avx512bf16");
}

int64_t bf16_isa() {
    if (!cpu_has_avx512bf16()) return corerun_cpu::has_avx512() ? BF_AVX512 : BF_SCALAR;
    return cpu_has_amx_bf16() ? BF_AMX : BF_AVX512BF16;
}

void bf16_gemv(at::Tensor out, const at::Tensor& packed, const at::Tensor& x, int64_t isa) {
    TORCH_CHECK(isa >= BF_SCALAR && isa <= bf16_isa(), "bf16_gemv: isa ", isa, " is not available on this CPU (best: ", bf16_isa(), ")");
    TORCH_CHECK(packed.device().is_cpu() && x.device().is_cpu() && out.device().is_cpu(), "bf16_gemv: CPU tensors only");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "bf16_gemv: x must be contiguous bfloat16 [T, cols], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), cols = x.size(1), npairs = (cols + 1) / 2, rows = out.size(1);
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == T && out.stride(1) == 1,
                "bf16_gemv: out must be bfloat16 [", T, ", rows] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
    TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == (rows + 15) / 16 &&
                    packed.size(1) == npairs * 32,
                "bf16_gemv: packed must be contiguous bfloat16 [", (rows + 15) / 16, ", ", npairs * 32, "] (repack_bf16's, for ", rows,
                " rows of ", cols, " columns), got ", packed.scalar_type(), " ", packed.sizes());
    if (T == 0 || rows == 0) return;
    const int64_t blocks = (rows + 15) / 16;
    // one token: AVX512_BF16's two-block stream is as fast (benchmarks/bf16_gemv_bench.py), with no tile state;
    // columns not a multiple of 32: no whole tiles
    if (isa == BF_AMX && (T == 1 || cols % 32 != 0)) isa = BF_AVX512BF16;
    if (isa == BF_AMX) {
        const int64_t Tpad = (T + 15) / 16 * 16;
        thread_local std::vector<uint16_t> padded;  // x's rows, zeros up to a whole A tile
        const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
        if (Tpad != T) {
            uint16_t* buf = corerun_amx::zeroed_scratch(padded, static_cast<size_t>(Tpad * cols));
            std::memcpy(buf, xs, static_cast<size_t>(T * cols) * 2);
            xs = buf;
        }
        const Bf16Tiles kernel{reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, T, out.stride(0)};
        const corerun_amx::Operands o{reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>()), reinterpret_cast<const char*>(xs),
                                      cols * 2, cols * 2, npairs * 64, Tpad};
        corerun_amx::product(kernel, o, blocks);
        return;
    }
    std::vector<uint32_t> xp(static_cast<size_t>(T * npairs), 0);
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t t = 0; t < T; ++t) {
        std::memcpy(xp.data() + t * npairs, xs + t * cols, static_cast<size_t>(cols) * 2);  // the odd column's partner stays 0
    }
    const Bf16Problem p{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), xp.data(),
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), npairs, rows, T, out.stride(0)};
    const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, npairs * 64));  // about 256 KiB of weights per task
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        if (isa == BF_AVX512BF16 && p.T == 1) one_token_dp_blocks(p, begin, end);
        else if (isa == BF_AVX512BF16) block_dp_blocks(p, begin, end);
        else if (isa == BF_AVX512) block_avx512_blocks(p, begin, end);
        else blocks_scalar(p, begin, end);
    });
}

void bf16_repack(at::Tensor packed, const at::Tensor& w) {
    TORCH_CHECK(w.device().is_cpu() && packed.device().is_cpu(), "bf16_repack: CPU tensors only");
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(), "bf16_repack: w must be contiguous bfloat16 [rows, cols], got ", w.scalar_type(), " ", w.sizes());
    const int64_t rows = w.size(0), cols = w.size(1), npairs = (cols + 1) / 2, blocks = (rows + 15) / 16;
    TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == blocks && packed.size(1) == npairs * 32,
                "bf16_repack: packed must be contiguous bfloat16 [", blocks, ", ", npairs * 32, "], got ", packed.scalar_type(), " ", packed.sizes());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            uint16_t* d = dst + b * npairs * 32;
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t row = 16 * b + r;
                for (int64_t i = 0; i < 2 * npairs; ++i)
                    d[((i / 2) * 16 + r) * 2 + (i & 1)] = row < rows && i < cols ? src[row * cols + i] : 0;
            }
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corerun_quant_cpu, m) {
    m.def("bf16_gemv(Tensor(a!) out, Tensor packed, Tensor x, int isa) -> ()");
    m.def("bf16_repack(Tensor(a!) packed, Tensor w) -> ()");
    m.def("bf16_isa() -> int", bf16_isa);
}

TORCH_LIBRARY_IMPL(corerun_quant_cpu, CPU, m) {
    m.impl("bf16_gemv", bf16_gemv);
    m.impl("bf16_repack", bf16_repack);
}
