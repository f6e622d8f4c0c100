// Causal attention of a step's fresh bfloat16 prompts (nothing cached before them) on AMX tiles.
//
// C ABI (called through ctypes; see kernels.py):
//   corerun_cpu_prefill_amx_available  1 when this build has the AMX path and the CPU / OS grant it
//   corerun_cpu_prefill_amx            every fresh prompt of one layer in one call
//
// Layouts (strides in elements, last dimension contiguous, all bfloat16):
//   q / out [num_tokens, num_heads, head_size], k / v [num_tokens, num_kv_heads, head_size]
//   ranges int32 [num_prompts, 2]: the prompt's rows [start, end) of q / k / v / out; each prompt attends
//   causally over its own keys only.
//
// Two phases on one OpenMP team (the runtime the paged kernel uses):
//  1. K and V of every (prompt, KV head) are repacked, 128 keys at a time, into the B-tile layouts of the
//     two products (zero past the prompt's end): for S = Q K^T a tile holds 16 keys x 32 head dims as 16
//     rows of 16 (dim pair) words, row i = dims 2i, 2i+1 of each key; for O = P V a tile holds 32 keys x
//     16 head dims as 16 rows, row i = keys 2i and 2i+1 interleaved per dim.
//  2. A work item is (prompt, KV head, tile of 32 query tokens); the G query heads of the group are stacked
//     (rows g * 32 + i), so each K/V tile is multiplied by 2G query tiles.  For each block of 128 keys up to
//     the diagonal (only the 32-key quarters the tile reaches): S (float32) by TDPBF16PS, then an online
//     softmax per row in AVX-512 (base 2: the scores are scaled by scale * log2(e) inside the exponent; the
//     causal mask only on the diagonal block), the probabilities rounded to bfloat16 (as flash attention
//     does) and summed in float32, and O (float32, in memory) rescaled only when the row's maximum passes
//     its reference by more than a factor 2^8 (LAZY), then O += P V by TDPBF16PS with O's tiles loaded and
//     stored.  At the end O / sum is rounded to bfloat16.
//  Items go longest first (a tile's cost grows with its position), dynamically scheduled.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__) && defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CORERUN_PREFILL_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace prefill_amx {

#ifdef CORERUN_PREFILL_AMX
constexpr int64_t BQ = 32;  // query tokens per tile (per query head)
constexpr int64_t BK = 128;  // keys per block: four k-steps of 32 for O += P V, eight key tiles for S
constexpr float LAZY = 8.0f;  // log2 of how far a probability may exceed 1 before the row's reference moves

// CPUID (AMX-TILE, AMX-BF16, AVX-512 F/BW, AVX512_BF16) and Linux's grant of the tile state, once per
// process (a CPUID can be a virtual machine's exit; the grant is process-wide).
bool ready() {
    static const bool ok = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!(d & (1u << 24)) || !(d & (1u << 22)) || !(b & (1u << 16)) || !(b & (1u << 30))) return false;
        unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
        if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 & (1u << 5))) return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};

// 2^t for t <= LAZY: t = n + f, |f| <= 1/2, 2^f by the degree-4 Taylor polynomial of exp(f ln 2) (relative
// error < 5e-5, a hundredth of the bfloat16 rounding of the result), times 2^n by vscalefps (0 far below
// -126).  t = -inf (a masked score) gives NaN: the caller zeroes those lanes.
inline __m512 exp2_poly(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);                  // ln2^4 / 24
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

struct Problem {
    const uint16_t* q;
    int64_t q_st, q_sh;
    const uint16_t* k;
    int64_t k_st, k_sh;
    const uint16_t* v;
    int64_t v_st, v_sh;
    uint16_t* out;
    int64_t o_st, o_sh;
    const int32_t* ranges;
    int64_t G, D;
    float scale2;                 // scale * log2(e)
    const int64_t* padded_start;  // per prompt: its first key's index in the repacked K / V (multiples of BK)
    int64_t padded_total;
    uint16_t* kp;  // [num_kv_heads][padded_total][D] in tile layout, per block of BK keys
    uint16_t* vp;
};

struct Job {
    int32_t prompt, head, block;  // repack: block of BK keys; attention: tile of BQ query tokens
};

inline const uint16_t* kv_row(const uint16_t* base, int64_t st, int64_t sh, int64_t token, int64_t head) {
    return base + token * st + head * sh;
}

// Block `block` of prompt `prompt`'s keys for KV head `head` into the two B-tile layouts (module comment):
// K as [key tile (BK / 16)][k-step (D / 32)] tiles, V as [32 keys (BK / 32)][16 head dims (D / 16)] tiles.
void repack(const Problem& P, const Job& j) {
    const int64_t D = P.D, start = P.ranges[2 * j.prompt], len = P.ranges[2 * j.prompt + 1] - start;
    const int64_t off = (j.head * P.padded_total + P.padded_start[j.prompt] + j.block * BK) * D, key0 = j.block * BK;
    uint16_t* kd = P.kp + off;
    uint16_t* vd = P.vp + off;
    const int64_t KS = D / 32, NV = D / 16;
    // only the steps of 32 keys a query tile reaches (attend_tile reads no further): up to the prompt's end
    const int64_t steps = std::min<int64_t>(BK / 32, (len - key0 + 31) / 32);
    for (int64_t n = 0; n < 2 * steps; ++n) {
        for (int64_t jj = 0; jj < 16; ++jj) {
            const int64_t key = key0 + 16 * n + jj;
            const uint16_t* src = key < len ? kv_row(P.k, P.k_st, P.k_sh, start + key, j.head) : nullptr;
            for (int64_t ks = 0; ks < KS; ++ks) {
                uint32_t* t = reinterpret_cast<uint32_t*>(kd + (n * KS + ks) * 512);
                for (int64_t i = 0; i < 16; ++i) {
                    uint32_t w = 0;
                    if (src) std::memcpy(&w, src + 32 * ks + 2 * i, 4);
                    t[i * 16 + jj] = w;
                }
            }
        }
    }
    for (int64_t h = 0; h < steps; ++h) {
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t a = key0 + 32 * h + 2 * i, b = a + 1;
            const uint16_t* ra = a < len ? kv_row(P.v, P.v_st, P.v_sh, start + a, j.head) : nullptr;
            const uint16_t* rb = b < len ? kv_row(P.v, P.v_st, P.v_sh, start + b, j.head) : nullptr;
            for (int64_t n = 0; n < NV; ++n) {
                uint16_t* t = vd + (h * NV + n) * 512 + i * 32;
                for (int64_t jj = 0; jj < 16; ++jj) {
                    t[2 * jj] = ra ? ra[16 * n + jj] : 0;
                    t[2 * jj + 1] = rb ? rb[16 * n + jj] : 0;
                }
            }
        }
    }
}

struct Scratch {
    uint16_t* q;  // [M][D] the stacked query rows
    float* s;     // [M][BK] scores (each head of the group its own rows: no reuse between neighbours)
    uint16_t* p;  // [M][BK] probabilities
    float* o;     // [M][D] accumulators
    float* m;     // [M] running maxima (scaled, base-2 units)
    float* l;     // [M][16] running sums, by lane
};

// Lanes of 16 keys starting at key `first` (relative to the row's own position `lim`) that the row sees.
inline __mmask16 visible(int64_t lim, int64_t first) {
    const int64_t n = lim - first + 1;
    return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// O's float32 C tiles 0-3 for the P V steps: rows o0 (and, when `two`, o1) times 32 head dims, 16 a tile, `stride`
// bytes between rows; loaded before the steps (Store false), stored after them (Store true).
template <bool Store>
inline void o_tiles(float* o0, float* o1, int64_t stride, bool two) {
    if constexpr (Store) {
        _tile_stored(0, o0, stride);
        _tile_stored(1, o0 + 16, stride);
        if (two) {
            _tile_stored(2, o1, stride);
            _tile_stored(3, o1 + 16, stride);
        }
    } else {
        _tile_loadd(0, o0, stride);
        _tile_loadd(1, o0 + 16, stride);
        if (two) {
            _tile_loadd(2, o1, stride);
            _tile_loadd(3, o1 + 16, stride);
        }
    }
}

void attend_tile(const Problem& P, const Job& j, const Scratch& w) {
    const int64_t G = P.G, D = P.D, M = G * BQ, KS = D / 32, NV = D / 16;
    const int64_t start = P.ranges[2 * j.prompt], len = P.ranges[2 * j.prompt + 1] - start;
    const int64_t q0 = j.block * BQ, nq = std::min<int64_t>(BQ, len - q0);
    for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = j.head * G + g;
        for (int64_t i = 0; i < BQ; ++i) {
            uint16_t* dst = w.q + (g * BQ + i) * D;
            if (i < nq) std::memcpy(dst, P.q + (start + q0 + i) * P.q_st + qh * P.q_sh, D * 2);
            else std::memset(dst, 0, D * 2);
        }
    }
    std::memset(w.o, 0, M * D * sizeof(float));
    std::memset(w.l, 0, M * 16 * sizeof(float));
    for (int64_t r = 0; r < M; ++r) w.m[r] = -INFINITY;
    const int64_t off = (j.head * P.padded_total + P.padded_start[j.prompt]) * D;
    const __m512 c2 = _mm512_set1_ps(P.scale2), ninf = _mm512_set1_ps(-INFINITY);
    const float inv_scale2 = 1.0f / P.scale2;
    // the tile's rows reach keys 0 .. q0 + nq - 1; a tail of at most 16 tokens takes one 16-row tile per head
    const int64_t reach = q0 + nq, last = (reach - 1) / BK;  // last: the block holding the tile's diagonal
    const bool two = nq > 16;
    for (int64_t kb = 0; kb <= last; ++kb) {
        const uint16_t* kt = P.kp + off + kb * BK * D;
        const uint16_t* vt = P.vp + off + kb * BK * D;
        // steps of 32 keys this tile reaches in the block (repack wrote them all)
        const int64_t steps = std::min<int64_t>(BK / 32, (reach - kb * BK + 31) / 32);
        // S = Q K^T: a head's two query tiles against two key tiles at a time (three phases over the whole
        // group, S, softmax, O += P V, measured ahead of interleaving them head by head)
        const bool diag = kb == last;
        const int64_t nv = 2 * steps;
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            for (int64_t h = 0; h < steps; ++h) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t* k0 = kt + 2 * h * KS * 512;
                for (int64_t ks = 0; ks < KS; ++ks) {
                    _tile_loadd(4, w.q + m0 * D + ks * 32, D * 2);
                    _tile_loadd(6, k0 + ks * 512, 64);
                    _tile_loadd(7, k0 + (KS + ks) * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, w.q + (m0 + 16) * D + ks * 32, D * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                float* s0 = w.s + m0 * BK + 32 * h;
                _tile_stored(0, s0, BK * 4);
                _tile_stored(1, s0 + 16, BK * 4);
                if (two) {
                    _tile_stored(2, s0 + 16 * BK, BK * 4);
                    _tile_stored(3, s0 + 16 * BK + 16, BK * 4);
                }
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            // online softmax, one row at a time (raw scores: the scale is positive, so the raw maximum is the
            // maximum); padding rows are skipped: their P rows (stale) only feed their own O rows, never stored
            for (int64_t r = m0; r < m0 + nq; ++r) {
                const float* sr = w.s + r * BK;
                __m512 x[BK / 16];
                __mmask16 mk[BK / 16];
                const int64_t lim = q0 + r % BQ - kb * BK;  // the row's own key, relative to the block
                __m512 mx = ninf;
                for (int64_t c = 0; c < nv; ++c) {
                    x[c] = _mm512_loadu_ps(sr + 16 * c);
                    if (diag) {
                        mk[c] = visible(lim, 16 * c);
                        x[c] = _mm512_mask_mov_ps(ninf, mk[c], x[c]);
                    }
                    mx = _mm512_max_ps(mx, x[c]);
                }
                // the reference moves only when the block's maximum passes it by more than LAZY (else the
                // probabilities, at most 2^LAZY, stay exact in float32 and the accumulators need no rescaling)
                // (compared as raw scores first: the horizontal maximum only when the reference moves)
                const float mold = w.m[r];
                float mnew = mold;
                if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps((mold + LAZY) * inv_scale2), _CMP_GT_OQ))
                    mnew = std::max(mold, _mm512_reduce_max_ps(mx) * P.scale2);
                float* lr = w.l + r * 16;
                __m512 lsum = _mm512_loadu_ps(lr);
                if (mnew > mold && kb > 0) {  // (block 0: nothing accumulated yet)
                    const __m512 alpha = exp2_poly(_mm512_set1_ps(mold - mnew));
                    lsum = _mm512_mul_ps(lsum, alpha);
                    float* orow = w.o + r * D;
                    for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(orow + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * c), alpha));
                }
                w.m[r] = mnew;
                const __m512 mv = _mm512_set1_ps(mnew);
                uint16_t* pr = w.p + r * BK;
                for (int64_t c = 0; c < nv; c += 2) {
                    __m512 p0 = exp2_poly(_mm512_fmsub_ps(x[c], c2, mv));
                    __m512 p1 = exp2_poly(_mm512_fmsub_ps(x[c + 1], c2, mv));
                    if (diag) p0 = _mm512_maskz_mov_ps(mk[c], p0), p1 = _mm512_maskz_mov_ps(mk[c + 1], p1);
                    lsum = _mm512_add_ps(lsum, _mm512_add_ps(p0, p1));
                    _mm512_storeu_si512(pr + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 16c.. in the low half
                }
                _mm512_storeu_ps(lr, lsum);
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            // O += P V, k-steps of 32 keys
            for (int64_t n = 0; n < NV; n += 2) {
                float* o0 = w.o + m0 * D + 16 * n;
                float* o1 = w.o + (m0 + 16) * D + 16 * n;
                o_tiles<false>(o0, o1, D * 4, two);
                for (int64_t h = 0; h < steps; ++h) {
                    _tile_loadd(4, w.p + m0 * BK + 32 * h, BK * 2);
                    _tile_loadd(6, vt + (h * NV + n) * 512, 64);
                    _tile_loadd(7, vt + (h * NV + n + 1) * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, w.p + (m0 + 16) * BK + 32 * h, BK * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                o_tiles<true>(o0, o1, D * 4, two);
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = j.head * G + g;
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t r = g * BQ + i;
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(w.l + r * 16)));
            uint16_t* dst = P.out + (start + q0 + i) * P.o_st + qh * P.o_sh;
            for (int64_t c = 0; c < NV; ++c) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.o + r * D + 16 * c), inv));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)h);
            }
        }
    }
}

// A buffer kept between calls (by the calling thread for the repacked K / V, by each pool thread for its
// scratch): the steps of a run ask for similar sizes, so after the first call nothing is allocated.
struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(ptr); }
    void* get(size_t n) {
        if (n > bytes) {
            std::free(ptr);
            bytes = ((n + 4095) / 4096) * 4096;
            ptr = std::aligned_alloc(64, bytes);
            if (!ptr) bytes = 0;
        }
        return ptr;
    }
};

bool run(const Problem& P, const std::vector<Job>& packs,
                                                                                    const std::vector<Job>& tiles, int num_threads) {
    const int64_t M = P.G * BQ, D = P.D;
    const size_t scratch = static_cast<size_t>(M * D * 2 + M * BK * 4 + M * BK * 2 + M * D * 4 + M * 4 + M * 64 + 6 * 64);
    bool ok = true;
    const int64_t np = static_cast<int64_t>(packs.size()), nt = static_cast<int64_t>(tiles.size());
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < np; ++i) repack(P, packs[i]);
        static thread_local Buffer mine;
        char* base = static_cast<char*>(mine.get(scratch));
        if (!base) {
#pragma omp atomic write
            ok = false;
        }
        Scratch w{};
        if (base) {
            auto carve = [&base](size_t n) { char* at = base; base += ((n + 63) / 64) * 64; return at; };
            w.q = reinterpret_cast<uint16_t*>(carve(M * D * 2));
            w.s = reinterpret_cast<float*>(carve(M * BK * 4));
            w.p = reinterpret_cast<uint16_t*>(carve(M * BK * 2));
            w.o = reinterpret_cast<float*>(carve(M * D * 4));
            w.m = reinterpret_cast<float*>(carve(M * 4));
            w.l = reinterpret_cast<float*>(carve(M * 64));
            TileConfig cfg;
            for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            _tile_loadconfig(&cfg);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nt; ++i)
            if (w.q) attend_tile(P, tiles[i], w);
        if (w.q) _tile_release();
    }
    return ok;
}
#endif  // CORERUN_PREFILL_AMX

}  // namespace prefill_amx
}  // namespace

extern "C" {

int corerun_cpu_prefill_amx_available(void) {
#ifdef CORERUN_PREFILL_AMX
    return prefill_amx::ready() ? 1 : 0;
#else
    return 0;
#endif
}

// Error codes written to err[0] (err[1..3] say where): 0 ok, 1 a range not within 0 .. num_tokens or
// reversed (prompt, start, end), 5 shape not taken (field: 0 head size, 1 heads; value), 6 out of memory,
// 7 no AMX path here (the caller keeps its other routes).
int corerun_cpu_prefill_amx(const void* q, int64_t q_st, int64_t q_sh, const void* k, int64_t k_st, int64_t k_sh,
                            const void* v, int64_t v_st, int64_t v_sh, void* out, int64_t o_st, int64_t o_sh,
                            const int32_t* ranges, int64_t num_prompts, int64_t num_tokens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_size, float scale, int num_threads, int64_t* err) {
    err[0] = err[1] = err[2] = err[3] = 0;
#ifndef CORERUN_PREFILL_AMX
    (void)q, (void)q_st, (void)q_sh, (void)k, (void)k_st, (void)k_sh, (void)v, (void)v_st, (void)v_sh, (void)out;
    (void)o_st, (void)o_sh, (void)ranges, (void)num_prompts, (void)num_tokens, (void)num_heads, (void)num_kv_heads;
    (void)head_size, (void)scale, (void)num_threads;
    err[0] = 7;
    return 7;
#else
    using namespace prefill_amx;
    if (!ready()) {
        err[0] = 7;
        return 7;
    }
    if (head_size != 64 && head_size != 128 || !(scale > 0.0f)) {
        err[0] = 5, err[1] = 0, err[2] = head_size;
        return 5;
    }
    if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads) {
        err[0] = 5, err[1] = 1, err[2] = num_heads, err[3] = num_kv_heads;
        return 5;
    }
    std::vector<int64_t> padded_start(static_cast<size_t>(num_prompts > 0 ? num_prompts : 0));
    int64_t total = 0;
    std::vector<Job> packs, tiles;
    for (int64_t p = 0; p < num_prompts; ++p) {
        const int64_t s0 = ranges[2 * p], s1 = ranges[2 * p + 1];
        if (s0 < 0 || s1 < s0 || s1 > num_tokens) {
            err[0] = 1, err[1] = p, err[2] = s0, err[3] = s1;
            return 1;
        }
        padded_start[p] = total;
        const int64_t blocks = (s1 - s0 + BK - 1) / BK, qtiles = (s1 - s0 + BQ - 1) / BQ;
        total += blocks * BK;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t b = 0; b < blocks; ++b)
                packs.push_back({static_cast<int32_t>(p), static_cast<int32_t>(h), static_cast<int32_t>(b)});
            for (int64_t t = 0; t < qtiles; ++t)
                tiles.push_back({static_cast<int32_t>(p), static_cast<int32_t>(h), static_cast<int32_t>(t)});
        }
    }
    if (tiles.empty()) return 0;
    // a tile's cost grows with its position: the longest first
    std::stable_sort(tiles.begin(), tiles.end(), [](const Job& a, const Job& b) { return a.block > b.block; });
    static thread_local Buffer kv;
    const size_t elems = static_cast<size_t>(num_kv_heads * total * head_size);
    auto* kvbuf = static_cast<uint16_t*>(kv.get(2 * elems * sizeof(uint16_t)));
    if (!kvbuf) {
        err[0] = 6;
        return 6;
    }
    const Problem P{static_cast<const uint16_t*>(q), q_st, q_sh, static_cast<const uint16_t*>(k), k_st, k_sh,
                    static_cast<const uint16_t*>(v), v_st, v_sh, static_cast<uint16_t*>(out), o_st, o_sh,
                    ranges, num_heads / num_kv_heads, head_size, scale * 1.4426950408889634f, padded_start.data(),
                    total, kvbuf, kvbuf + elems};
    if (!run(P, packs, tiles, num_threads < 1 ? 1 : num_threads)) {
        err[0] = 6;
        return 6;
    }
    return 0;
#endif
}

}  // extern "C"
