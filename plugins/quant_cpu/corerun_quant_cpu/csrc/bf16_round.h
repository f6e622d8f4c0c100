// float32 -> bfloat16 rounded to nearest even (as torch's .to(torch.bfloat16)) on sixteen lanes, for CPUs without
// AVX512_BF16's vcvtneps2bf16; a NaN stays a NaN.  Shared by bf16_gemv.cpp and int8_vnni.cpp.

#pragma once

#include <immintrin.h>

namespace corerun_bf16 {

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m256i round16(__m512 y) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

}  // namespace corerun_bf16
