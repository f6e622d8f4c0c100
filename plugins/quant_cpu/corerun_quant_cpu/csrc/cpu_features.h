// The CPU feature tests the kernels dispatch on at run time (cpuid, through GCC's __builtin_cpu_supports),
// shared by the sources that compile the same target (bf16_gemv.cpp, f32_gemv.cpp: AVX-512; gguf_gemv.cpp, gguf_k.cpp:
// AVX2).
#pragma once

namespace corerun_cpu {

// AVX-512 F, BW and VL with AVX2 and FMA: what the AVX-512 paths' target attributes ask for
inline bool has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// AVX2 with FMA and F16C: what the AVX2 paths' target attributes ask for
inline bool has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace corerun_cpu
