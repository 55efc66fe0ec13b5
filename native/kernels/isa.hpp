// The vector instructions zoo's own conversion loops use (rounding fp32 to bf16, widening a
// stored int8/nf4/bf16 matrix: bf16.hpp, quant.hpp), picked once at run time from the CPU, not
// from the build's flags: the same binary then runs each x86 class at full speed, a build
// without -march=native keeps its vector paths, and a test can force every path on one machine
// and compare it with the scalar one. Elsewhere (ARM) only the scalar path exists, which the
// compiler vectorizes for the target as it can.
//
// The path is the best the CPU has, lowered to the class oneDNN runs at where the build has
// oneDNN: DNNL_MAX_CPU_ISA (e.g. AVX2, AVX512_CORE) then makes all of zoo behave as a CPU of
// that class would (docs/benchmarks.md, "CPU classes").
#pragma once
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#define ZOO_X86 1
#include <immintrin.h>
#endif

namespace zoo {

enum class VectorIsa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };

inline const char* vector_isa_name(VectorIsa v) {
    switch (v) {
        case VectorIsa::avx2: return "avx2";
        case VectorIsa::avx512: return "avx512";
        case VectorIsa::avx512_bf16: return "avx512_bf16";
        default: return "scalar";
    }
}

// The best path this CPU (and its OS, which must save the wider registers) can run.
inline VectorIsa cpu_vector_isa() {
#if defined(ZOO_X86)
    __builtin_cpu_init();
    // AVX-512 paths use F (the registers), BW (byte and word conversions) and VL (256-bit
    // forms); AVX2 ones also FMA and F16C-era conversions (present on every AVX2 CPU).
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return VectorIsa::avx512_bf16;
    if (avx512) return VectorIsa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return VectorIsa::avx2;
#endif
    return VectorIsa::scalar;
}

// Defined in gemm.cpp: the class oneDNN runs at here (lowered by DNNL_MAX_CPU_ISA); without
// oneDNN, the class DNNL_MAX_CPU_ISA names (avx512_bf16, no cap, where it names none).
VectorIsa onednn_vector_isa_cap();

namespace detail {
inline VectorIsa& vector_isa_slot() {
    static VectorIsa v = [] {
        const VectorIsa cpu = cpu_vector_isa(), cap = onednn_vector_isa_cap();
        return (int)cap < (int)cpu ? cap : cpu;
    }();
    return v;
}
}  // namespace detail

inline VectorIsa vector_isa() { return detail::vector_isa_slot(); }

// Forces a path (tests, benchmarks): "scalar", "avx2", "avx512", "avx512_bf16", or "auto"
// (back to the default). A path the CPU cannot run is refused by name.
inline void set_vector_isa(const std::string& name) {
    VectorIsa want;
    if (name == "auto") {
        const VectorIsa cpu = cpu_vector_isa(), cap = onednn_vector_isa_cap();
        detail::vector_isa_slot() = (int)cap < (int)cpu ? cap : cpu;
        return;
    } else if (name == "scalar") {
        want = VectorIsa::scalar;
    } else if (name == "avx2") {
        want = VectorIsa::avx2;
    } else if (name == "avx512") {
        want = VectorIsa::avx512;
    } else if (name == "avx512_bf16") {
        want = VectorIsa::avx512_bf16;
    } else {
        throw std::invalid_argument("zoo: vector path '" + name +
                                    "' is unknown (scalar, avx2, avx512, avx512_bf16 or auto)");
    }
    if ((int)want > (int)cpu_vector_isa())
        throw std::invalid_argument(std::string("zoo: vector path '") + name + "' needs instructions this CPU lacks (it has " +
                                    vector_isa_name(cpu_vector_isa()) + ")");
    detail::vector_isa_slot() = want;
}

}  // namespace zoo
