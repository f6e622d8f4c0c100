// One token through a range of 16-row blocks in several streams from memory (bf16_gemv.cpp, f32_gemv.cpp).
//
// A one-token product is bound by how fast one core pulls the weights from memory.  Taking S row blocks side
// by side, each from its own part of the range and walking that part front to back, keeps S sequential
// streams in flight (these streams measured faster with no software prefetch: the hardware's prefetchers follow
// each; bf16_gemv.cpp's BF_PREFETCH).  Through the default
// model's weights on one thread of an AMD EPYC (Zen 4), ratio to oneDNN's time in the same run
// (benchmarks/bf16_gemv_bench.py --model, benchmarks/f32_gemv_bench.py; benchmarks/RESULTS.md, "Twentieth
// session"): bfloat16 with 2 adjacent blocks side by side 0.70, 2 streams over halves 0.70, 3 0.61, 4 0.54-0.59,
// 6 0.59, 8 0.80; float32 with 2 adjacent blocks 0.63, 4 streams 0.52.
#pragma once

#include <cstdint>

namespace corerun_cpu {

constexpr int ONE_TOKEN_STREAMS = 4;

// Calls blocks(blk) with blk[k] = begin + k * part + i (part = (end - begin) / S) for i = 0 .. part - 1;
// returns the first block it left out (the last (end - begin) % S, for the caller to take one at a time).
template <int S, typename Blocks>
inline int64_t row_block_streams(int64_t begin, int64_t end, Blocks&& blocks) {
    const int64_t part = (end - begin) / S;
    for (int64_t i = 0; i < part; ++i) {
        int64_t blk[S];
        for (int k = 0; k < S; ++k) blk[k] = begin + k * part + i;
        blocks(static_cast<const int64_t*>(blk));
    }
    return begin + S * part;
}

}  // namespace corerun_cpu
