// AMX tile products shared by bf16_gemv.cpp (TDPBF16PS) and int8_amx.cpp (TDPBSSD).
//
// Both multiply a few tokens' activations A [Tpad, K] (row-major, Tpad a multiple of 16, rows past the
// real tokens zero) by a weight repacked in row blocks of 16 output rows, each block one sequential
// stream of 64-byte vectors, 16 consecutive vectors (1 KiB) one B tile covering 64 bytes of K.  A task
// takes two row blocks at a time (two B tiles streamed from memory) against 32 tokens at a time (two A
// tiles, 16 tokens x 64 bytes each, read at A's row stride): four C tiles (16 x 16 32-bit sums), the
// eight tile registers.  More than 32 tokens re-read the two blocks' tiles from L1/L2, so a call reads
// its weights from memory once.  The first pass prefetches each block's next tiles 4 KiB ahead.
//
// That loop (row_blocks) serves fewer than tuning().large_tokens tokens (padded to 16).  From there on
// (product), the tokens go in chunks of chunk_tokens and the row blocks in groups of about group_bytes of
// weights; a task is one chunk against one group (panel): for every 32 tokens of the chunk (A's 32 rows,
// kept in L1), each pair of the group's row blocks (kept in L2 after the chunk's first 32 tokens), the sums
// over the whole K in the four C tiles.  The old loop re-read A (T x K bytes, from L2 or memory past a few
// hundred tokens) for every pair of row blocks.  A tile load that misses L1 costs: on this machine the four
// C tiles reach about 4.6 int8 TOPS with both operands in L1 and about 2 with one of them from L2
// (benchmarks/RESULTS.md, tenth session).  Tasks are split over at::parallel_for, with as many row groups
// as the threads need to share them evenly.
//
// A Kernel supplies: `static constexpr Op op` (the tile instruction: the macros take literal tile numbers),
// `static constexpr bool overlap_store` (many tokens: whether a pair's store epilogue runs while the next
// pair's products are in flight, two C buffers; measured per op, benchmarks/RESULTS.md) and
// `void store(const int32_t* or float* c, int mt, int nb, int64_t m0, int64_t block)` (C tiles, laid out
// [mt][2][16][16] 32-bit words, to the output: rows past the real tokens dropped).

#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace corerun_amx {

#define CORERUN_AMX_FN __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

constexpr int64_t PREFETCH = 4096;  // bytes ahead in a row block's stream (each of the tile's 16 lines)

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};

// Whether the CPU has AMX-TILE and the AMX feature in cpuid leaf 7's EDX bit `feature_bit` (22: BF16,
// 25: INT8) with AVX-512 F/BW, and Linux grants this process the tile state.  CPUID and the request are
// made once per process (a CPUID can cost microseconds: a virtual machine's exit), so every kernel call
// may ask.
inline bool available(unsigned feature_bit) {
    struct Leaf7 {
        unsigned b = 0, d = 0;
        bool granted = false;
    };
    static const Leaf7 leaf = [] {
        Leaf7 l;
        unsigned a = 0, c = 0;
        if (!__get_cpuid_count(7, 0, &a, &l.b, &c, &l.d)) return l;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        l.granted = (l.d & (1u << 24)) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        return l;
    }();
    return leaf.granted && (leaf.d & (1u << feature_bit)) && (leaf.b & (1u << 16)) && (leaf.b & (1u << 30));
}

// A per-thread scratch buffer of at least n elements, zero-filled, kept between calls (a decode step's
// products would otherwise allocate and free one per call).
template <typename T>
inline T* zeroed_scratch(std::vector<T>& buffer, size_t n) {
    if (buffer.size() < n) buffer.resize(n);
    std::fill(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(n), T(0));
    return buffer.data();
}

enum class Op { bf16, int8 };  // TDPBF16PS (float32 sums) or TDPBSSD (int32 sums of signed bytes)

#define CORERUN_AMX_DP(C, A, B)                                          \
    do {                                                                 \
        if constexpr (Kernel::op == Op::bf16) _tile_dpbf16ps(C, A, B);   \
        else _tile_dpbssd(C, A, B);                                      \
    } while (0)

struct Operands {
    const char* w;       // the repacked weight: blocks of block_bytes each
    const char* a;       // A [Tpad, a_stride bytes]
    int64_t k_bytes;     // bytes of K per token (a multiple of 64)
    int64_t a_stride;    // bytes between A's rows
    int64_t block_bytes; // bytes per row block (16 * k_bytes)
    int64_t Tpad;
};

struct Nothing {
    void operator()() const {}
};

// `between` runs after the last tile product is issued and before the C tiles are stored: work that does
// not touch the tiles (the previous tiles' store epilogue) overlaps the products still in flight.
template <class Kernel, int MT, int NB, class Between = Nothing>
CORERUN_AMX_FN void tiles(const Operands& o, const char* w0, const char* w1, int64_t m0, void* c, bool prefetch, const Between& between = Between()) {
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NB == 2) _tile_zero(3);
    const char* a = o.a + m0 * o.a_stride;
    for (int64_t k = 0; k < o.k_bytes; k += 64) {
        const int64_t at = k * 16;  // the B tile of these 64 bytes of K: 16 vectors of 64 bytes
        if (prefetch) {
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch(w0 + at + PREFETCH + l, _MM_HINT_T0);
                if constexpr (NB == 2) _mm_prefetch(w1 + at + PREFETCH + l, _MM_HINT_T0);
            }
        }
        _tile_loadd(6, w0 + at, 64);
        if constexpr (NB == 2) _tile_loadd(7, w1 + at, 64);
        _tile_loadd(4, a + k, o.a_stride);
        CORERUN_AMX_DP(0, 4, 6);
        if constexpr (NB == 2) CORERUN_AMX_DP(1, 4, 7);
        if constexpr (MT == 2) {
            _tile_loadd(5, a + 16 * o.a_stride + k, o.a_stride);
            CORERUN_AMX_DP(2, 5, 6);
            if constexpr (NB == 2) CORERUN_AMX_DP(3, 5, 7);
        }
    }
    between();
    char* cb = static_cast<char*>(c);
    _tile_stored(0, cb, 64);
    if constexpr (NB == 2) _tile_stored(1, cb + 1024, 64);
    if constexpr (MT == 2) _tile_stored(2, cb + 2048, 64);
    if constexpr (MT == 2 && NB == 2) _tile_stored(3, cb + 3072, 64);
}

// One pair of row blocks (or one, `two` false) against mt (1 or 2) A tiles from token m0, stored.
template <class Kernel>
CORERUN_AMX_FN inline void pair_product(const Kernel& kernel, const Operands& o, const char* w0, const char* w1, bool two, int64_t m0, int mt,
                                        int64_t b, int32_t* c, bool prefetch) {
    if (mt == 2 && two) tiles<Kernel, 2, 2>(o, w0, w1, m0, c, prefetch);
    else if (mt == 2) tiles<Kernel, 2, 1>(o, w0, w1, m0, c, prefetch);
    else if (two) tiles<Kernel, 1, 2>(o, w0, w1, m0, c, prefetch);
    else tiles<Kernel, 1, 1>(o, w0, w1, m0, c, prefetch);
    kernel.store(c, mt, two ? 2 : 1, m0, b);
}

// Row blocks [begin, end) of one task, two at a time, every 32 tokens of A against each pair.
template <class Kernel>
CORERUN_AMX_FN void row_blocks(const Kernel& kernel, const Operands& o, int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) int32_t c[4 * 256];
    for (int64_t b = begin; b < end; b += 2) {
        const bool two = b + 1 < end;
        const char* w0 = o.w + b * o.block_bytes;
        const char* w1 = two ? w0 + o.block_bytes : w0;
        for (int64_t m0 = 0; m0 < o.Tpad; m0 += 32) {
            const int mt = o.Tpad - m0 >= 32 ? 2 : 1;
            pair_product(kernel, o, w0, w1, two, m0, mt, b, c, m0 == 0);
        }
    }
    _tile_release();
}

// Many tokens: tunables (process-wide; benchmarks and tests move them).  large_tokens: from this many
// tokens on, the blocked path below; group_bytes: weight bytes of one row group (kept in L2 across a
// token chunk); chunk_tokens: tokens of one chunk (a multiple of 32); order: 0 = within a group, every 32
// tokens against each pair of blocks (A from L1, B from L2), 1 = each pair against every 32 tokens.
struct Tuning {
    int64_t large_tokens = 64, group_bytes = 256 * 1024, chunk_tokens = 256, order = 0;
};
inline Tuning& tuning() {
    static Tuning t;
    return t;
}

// Blocks [b_begin, b_end) (b_begin even) against tokens [m_begin, m_end) (m_begin a multiple of 32, m_end
// a multiple of 16).
template <class Kernel>
CORERUN_AMX_FN void panel(const Kernel& kernel, const Operands& o, int64_t b_begin, int64_t b_end, int64_t m_begin, int64_t m_end, int64_t order) {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) int32_t c[4 * 256];
    if (order == 0 && Kernel::overlap_store) {
        // two C buffers: the tiles of one pair are stored while the next pair's products run
        alignas(64) int32_t cs[2][4 * 256];
        struct Pending {
            int mt = 0, nb = 0;
            int64_t m0 = 0, b = 0;
            const int32_t* c = nullptr;
        } pending;
        int flip = 0;
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
            const int mt = m_end - m0 >= 32 ? 2 : 1;
            for (int64_t b = b_begin; b < b_end; b += 2) {
                const bool two = b + 1 < b_end;
                const char* w0 = o.w + b * o.block_bytes;
                const char* w1 = two ? w0 + o.block_bytes : w0;
                const bool pf = m0 == m_begin;
                const auto flush = [&] {
                    if (pending.c) kernel.store(pending.c, pending.mt, pending.nb, pending.m0, pending.b);
                };
                int32_t* cur = cs[flip];
                if (mt == 2 && two) tiles<Kernel, 2, 2>(o, w0, w1, m0, cur, pf, flush);
                else if (mt == 2) tiles<Kernel, 2, 1>(o, w0, w1, m0, cur, pf, flush);
                else if (two) tiles<Kernel, 1, 2>(o, w0, w1, m0, cur, pf, flush);
                else tiles<Kernel, 1, 1>(o, w0, w1, m0, cur, pf, flush);
                pending = Pending{mt, two ? 2 : 1, m0, b, cur};
                flip ^= 1;
            }
        }
        if (pending.c) kernel.store(pending.c, pending.mt, pending.nb, pending.m0, pending.b);
    } else if (order == 0) {
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
            const int mt = m_end - m0 >= 32 ? 2 : 1;
            for (int64_t b = b_begin; b < b_end; b += 2) {
                const bool two = b + 1 < b_end;
                const char* w0 = o.w + b * o.block_bytes;
                pair_product(kernel, o, w0, two ? w0 + o.block_bytes : w0, two, m0, mt, b, c, m0 == m_begin);
            }
        }
    } else {
        for (int64_t b = b_begin; b < b_end; b += 2) {
            const bool two = b + 1 < b_end;
            const char* w0 = o.w + b * o.block_bytes;
            for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
                const int mt = m_end - m0 >= 32 ? 2 : 1;
                pair_product(kernel, o, w0, two ? w0 + o.block_bytes : w0, two, m0, mt, b, c, m0 == m_begin);
            }
        }
    }
    _tile_release();
}

// The whole product: few tokens, pairs of row blocks split over the threads (about 256 KiB of weights a
// task); many, token chunks times row groups.
template <class Kernel>
void product(const Kernel& kernel, const Operands& o, int64_t blocks) {
    const Tuning tu = tuning();
    if (o.Tpad < tu.large_tokens) {
        const int64_t grain_pairs = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, 2 * o.block_bytes));
        at::parallel_for(0, (blocks + 1) / 2, grain_pairs, [&](int64_t begin, int64_t end) {
            row_blocks(kernel, o, 2 * begin, std::min(blocks, 2 * end));
        });
        return;
    }
    const int64_t chunk = std::max<int64_t>(32, tu.chunk_tokens / 32 * 32), nm = (o.Tpad + chunk - 1) / chunk;
    // groups of about group_bytes, as many as the threads need to share the tasks evenly, of equal size (even)
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    int64_t ng = std::max<int64_t>(1, (blocks * o.block_bytes + tu.group_bytes - 1) / std::max<int64_t>(1, tu.group_bytes));
    if (nm % threads != 0) ng = (ng + threads - 1) / threads * threads;
    const int64_t group = std::max<int64_t>(2, ((blocks + ng - 1) / ng + 1) / 2 * 2);
    ng = (blocks + group - 1) / group;
    at::parallel_for(0, nm * ng, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t mi = task / ng, gi = task % ng;
            panel(kernel, o, gi * group, std::min(blocks, (gi + 1) * group), mi * chunk, std::min(o.Tpad, (mi + 1) * chunk), tu.order);
        }
    });
}

}  // namespace corerun_amx
