// bf16 storage for the activations a bf16 step saves for its pullbacks. autocast keeps a
// product's output in bf16; zoo does the same for the outputs it keeps from forward to pullback
// (q|k|v, the attention output, the MLP input), so they cost half the memory. The value is
// rounded where it is made, and the forward goes on with the rounded value: the pullback then
// reads exactly what the forward used.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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

// n values rounded to bf16: one instruction per 16 where the CPU has AVX512_BF16 (which rounds
// to nearest even and keeps NaN a NaN, as to_bf16), to_bf16's arithmetic elsewhere.
inline void to_bf16_row(const float* __restrict x, uint16_t* __restrict out, size_t n) {
    size_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i*)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
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
