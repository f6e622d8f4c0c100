// The CPU feature tests the kernels dispatch on at run time (cpuid, through GCC's __builtin_cpu_supports),
// shared by the sources that compile the same AVX-512 target (bf16_gemv.cpp, f32_gemv.cpp).
#pragma once

namespace corerun_cpu {

// AVX-512 F, BW and VL with AVX2 and FMA: what the AVX-512 paths' target attributes ask for
inline bool has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace corerun_cpu
