// bf16 storage for the activations a bf16 step saves for its pullbacks. autocast keeps a
// product's output in bf16; zoo does the same for the outputs it keeps from forward to pullback
// (q|k|v, the attention output, the MLP input), so they cost half the memory. The value is
// rounded where it is made, and the forward goes on with the rounded value: the pullback then
// reads exactly what the forward used.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/isa.hpp"

namespace zoo {

// Round to nearest even; NaN stays NaN (the carry would turn a NaN with low payload into Inf).
inline uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

inline float from_bf16(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

#if defined(ZOO_X86)
// 8 or 16 values rounded to bf16 as to_bf16 does (nearest even, a NaN stays a quiet NaN), for
// the CPUs without AVX512_BF16's conversion instruction.
namespace vec {
__attribute__((target("avx2,fma"))) inline __m128i bf16x8_avx2(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each < 2^16
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m256i bf16x16_avx512(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
// One instruction where the CPU has AVX512_BF16. It rounds as to_bf16 does, except that it
// flushes denormal inputs to zero (below 2^-126: nothing a product of bf16 operands notices).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m256i bf16x16_avx512_bf16(__m512 x) {
    return (__m256i)_mm512_cvtneps_pbh(x);
}

__attribute__((target("avx2,fma"))) inline size_t to_bf16_row_avx2(const float* x, uint16_t* out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i*)(out + i), bf16x8_avx2(_mm256_loadu_ps(x + i)));
    return i;
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline size_t to_bf16_row_avx512(
    const float* x, uint16_t* out, size_t n, bool native_bf16) {
    size_t i = 0;
    if (native_bf16)
        for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i*)(out + i), bf16x16_avx512_bf16(_mm512_loadu_ps(x + i)));
    else
        for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i*)(out + i), bf16x16_avx512(_mm512_loadu_ps(x + i)));
    return i;
}
}  // namespace vec
#endif

// n values rounded to bf16, on the vector path the CPU has (isa.hpp), the scalar tail after it.
inline void to_bf16_row(const float* __restrict x, uint16_t* __restrict out, size_t n) {
    size_t i = 0;
#if defined(ZOO_X86)
    switch (vector_isa()) {
        case VectorIsa::avx512_bf16: i = vec::to_bf16_row_avx512(x, out, n, true); break;
        case VectorIsa::avx512: i = vec::to_bf16_row_avx512(x, out, n, false); break;
        case VectorIsa::avx2: i = vec::to_bf16_row_avx2(x, out, n); break;
        default: break;
    }
#endif
    for (; i < n; i++) out[i] = to_bf16(x[i]);
}

// x[i] rounded to bf16 in place, and the same bits kept in saved[i].
inline void round_and_save_bf16(float* __restrict x, uint16_t* __restrict saved, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        saved[i] = to_bf16(x[i]);
        x[i] = from_bf16(saved[i]);
    }
}

inline void expand_bf16(const uint16_t* __restrict saved, float* __restrict x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = from_bf16(saved[i]);
}

}  // namespace zoo
