// Storage formats of a frozen weight matrix (a LoRA run's base, docs/lora.md). A matrix of
// (rows, cols), row-major, stored as one block of bytes: its values, then (int8, nf4) its
// float scales. The products read it through gemm::matrix_* (gemm.hpp), which widen it a tile
// of rows at a time: never the whole matrix in fp32.
//   f32   4 bytes a value.
//   bf16  2 bytes: rounded to nearest even; |error| <= 2^-8 |w|.
//   int8  1 byte, one scale per row (per output channel): w = q s, s = max|row| / 127;
//         |error| <= s / 2 = max|row| / 254.
//   nf4   4 bits (two values a byte), one scale per block of 64 values along a row: w =
//         NF4[q] s, s = max|block| (the NormalFloat levels of QLoRA, which fit normally
//         distributed weights); |error| <= s (NF4[1] - NF4[0]) / 2 = 0.152 s, half the widest gap.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <cstring>
#include <string>

#include "kernels/bf16.hpp"
#include "kernels/isa.hpp"

namespace zoo {

enum class DType : int { f32 = 0, bf16 = 1, int8 = 2, nf4 = 3 };
inline const char* dtype_name(DType t) {
    switch (t) {
        case DType::bf16: return "bf16";
        case DType::int8: return "int8";
        case DType::nf4: return "nf4";
        default: return "fp32";
    }
}
inline DType dtype_named(const std::string& name) {
    if (name == "fp32") return DType::f32;
    if (name == "bf16") return DType::bf16;
    if (name == "int8") return DType::int8;
    if (name == "nf4") return DType::nf4;
    throw std::invalid_argument("zoo: weight format '" + name + "' is unknown (fp32, bf16, int8 or nf4)");
}

constexpr int nf4_block = 64;
inline const float nf4_levels[16] = {
    -1.0f,       -0.6961928f, -0.52507305f, -0.39491749f, -0.28444138f, -0.18477343f, -0.09105004f, 0.0f,
    0.07958030f, 0.16093020f, 0.24611230f,  0.33791524f,  0.44070983f,  0.56261700f,  0.72295684f,  1.0f};

// Halfway between neighbouring levels: where rounding to the nearest level changes.
inline const float nf4_midpoints[15] = {
    (nf4_levels[0] + nf4_levels[1]) / 2,   (nf4_levels[1] + nf4_levels[2]) / 2,   (nf4_levels[2] + nf4_levels[3]) / 2,
    (nf4_levels[3] + nf4_levels[4]) / 2,   (nf4_levels[4] + nf4_levels[5]) / 2,   (nf4_levels[5] + nf4_levels[6]) / 2,
    (nf4_levels[6] + nf4_levels[7]) / 2,   (nf4_levels[7] + nf4_levels[8]) / 2,   (nf4_levels[8] + nf4_levels[9]) / 2,
    (nf4_levels[9] + nf4_levels[10]) / 2,  (nf4_levels[10] + nf4_levels[11]) / 2, (nf4_levels[11] + nf4_levels[12]) / 2,
    (nf4_levels[12] + nf4_levels[13]) / 2, (nf4_levels[13] + nf4_levels[14]) / 2, (nf4_levels[14] + nf4_levels[15]) / 2};

inline size_t nf4_blocks(size_t cols) { return (cols + nf4_block - 1) / nf4_block; }

// Bytes of the values, and of the whole block (values, then the scales 64-byte aligned).
inline size_t value_bytes(DType t, size_t rows, size_t cols) {
    switch (t) {
        case DType::bf16: return rows * cols * 2;
        case DType::int8: return rows * cols;
        case DType::nf4: return rows * nf4_blocks(cols) * (nf4_block / 2);
        default: return rows * cols * 4;
    }
}
inline size_t scale_count(DType t, size_t rows, size_t cols) {
    return t == DType::int8 ? rows : t == DType::nf4 ? rows * nf4_blocks(cols) : 0;
}
inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }
inline size_t storage_bytes(DType t, size_t rows, size_t cols) {
    return align64(value_bytes(t, rows, cols)) + align64(4 * scale_count(t, rows, cols));
}

// A read-only view of a stored matrix.
struct Matrix {
    const void* data = nullptr;
    DType dtype = DType::f32;
    int rows = 0, cols = 0;
    // A bf16 matrix's second copy, its blocks of rows packed for matrix_xw (gemm::pack_xw), or
    // null: matrix_xw then reads data as stored.
    const void* packed_xw = nullptr;

    Matrix() = default;
    Matrix(const void* d, DType t, int r, int c) : data(d), dtype(t), rows(r), cols(c) {}
    const float* f32() const { return static_cast<const float*>(data); }
    const float* scales() const {
        return reinterpret_cast<const float*>(static_cast<const uint8_t*>(data) +
                                              align64(value_bytes(dtype, rows, cols)));
    }
};

// Values [c0, c1) of row r of m widened, to fp32 (Out float) or bf16 bits (Out uint16_t); c0 a
// multiple of nf4_block. The scalar path: every CPU, and the tail of the vector paths.
template <class Out>
inline void widen_row_range_scalar(const Matrix& m, size_t r, size_t c0, size_t c1, Out* out) {
    constexpr bool to_bf16_bits = sizeof(Out) == 2;
    auto put = [&](size_t c, float x) {
        if constexpr (to_bf16_bits) out[c - c0] = to_bf16(x);
        else out[c - c0] = x;
    };
    const size_t C = m.cols;
    switch (m.dtype) {
        case DType::bf16: {
            const uint16_t* v = static_cast<const uint16_t*>(m.data) + r * C;
            if constexpr (to_bf16_bits) std::memcpy(out, v + c0, 2 * (c1 - c0));
            else
                for (size_t c = c0; c < c1; c++) put(c, from_bf16(v[c]));
            return;
        }
        case DType::int8: {
            const int8_t* v = static_cast<const int8_t*>(m.data) + r * C;
            const float s = m.scales()[r];
            for (size_t c = c0; c < c1; c++) put(c, v[c] * s);
            return;
        }
        case DType::nf4: {
            const size_t nb = nf4_blocks(C);
            const uint8_t* v = static_cast<const uint8_t*>(m.data) + r * nb * (nf4_block / 2);
            const float* s = m.scales() + r * nb;
            for (size_t c = c0; c < c1; c++) {
                const uint8_t byte = v[c / 2];
                put(c, nf4_levels[(c & 1) ? byte >> 4 : byte & 15] * s[c / nf4_block]);
            }
            return;
        }
        default:
            for (size_t c = c0; c < c1; c++) put(c, m.f32()[r * C + c]);
    }
}

#if defined(ZOO_X86)
// The vector paths (isa.hpp picks one at run time): the products widen every stored matrix
// once per pass, so this runs over the whole model two or three times a step (scalar, it cost
// more than the products of an 8B model's LoRA step; docs/lora.md). Each returns the column
// where its vectors stop; the scalar path does the rest. Groups of 8 or 16 values never
// straddle an nf4 block of 64, since c0 is a multiple of 64.
namespace vec {
__attribute__((target("avx2,fma"))) inline __m256 int8x8_avx2(const int8_t* v, __m256 scale) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)v))), scale);
}
// 4 bytes of nf4 codes (8 values, low nibble first) as fp32: levels 0-7 and 8-15 looked up by
// the code's low 3 bits, chosen by its fourth.
__attribute__((target("avx2,fma"))) inline __m256 nf4x8_avx2(const uint8_t* v, __m256 low_levels,
                                                              __m256 high_levels, __m256 scale) {
    int32_t four;
    std::memcpy(&four, v, 4);
    const __m128i b = _mm_cvtsi32_si128(four), nibble = _mm_set1_epi8(15);
    const __m256i codes = _mm256_cvtepu8_epi32(
        _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble)));
    const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(codes, _mm256_set1_epi32(7)));
    const __m256 x = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_levels, codes),
                                      _mm256_permutevar8x32_ps(high_levels, codes), high);
    return _mm256_mul_ps(x, scale);
}
__attribute__((target("avx2,fma"))) inline __m256 bf16x8_to_f32_avx2(const uint16_t* v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)v)), 16));
}
template <class Out>
__attribute__((target("avx2,fma"))) inline void put8_avx2(Out* out, __m256 x) {
    if constexpr (sizeof(Out) == 2) _mm_storeu_si128((__m128i*)out, bf16x8_avx2(x));
    else _mm256_storeu_ps((float*)out, x);
}
template <class Out>
__attribute__((target("avx2,fma"))) inline size_t widen_avx2(const Matrix& m, size_t r, size_t c0, size_t c1, Out* out) {
    const size_t C = m.cols;
    size_t c = c0;
    switch (m.dtype) {
        case DType::bf16: {
            const uint16_t* v = static_cast<const uint16_t*>(m.data) + r * C;
            if constexpr (sizeof(Out) == 4)
                for (; c + 8 <= c1; c += 8) _mm256_storeu_ps((float*)out + (c - c0), bf16x8_to_f32_avx2(v + c));
            break;
        }
        case DType::int8: {
            const int8_t* v = static_cast<const int8_t*>(m.data) + r * C;
            const __m256 s = _mm256_set1_ps(m.scales()[r]);
            for (; c + 8 <= c1; c += 8) put8_avx2(out + (c - c0), int8x8_avx2(v + c, s));
            break;
        }
        case DType::nf4: {
            const size_t nb = nf4_blocks(C);
            const uint8_t* v = static_cast<const uint8_t*>(m.data) + r * nb * (nf4_block / 2);
            const float* s = m.scales() + r * nb;
            const __m256 low = _mm256_loadu_ps(nf4_levels), high = _mm256_loadu_ps(nf4_levels + 8);
            for (; c + 8 <= c1; c += 8)
                put8_avx2(out + (c - c0), nf4x8_avx2(v + c / 2, low, high, _mm256_set1_ps(s[c / nf4_block])));
            break;
        }
        default: break;
    }
    return c;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 int8x16_avx512(const int8_t* v, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)v))), scale);
}
// 8 bytes of nf4 codes (16 values, low nibble first) as fp32: one lookup of the 16 levels.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 nf4x16_avx512(const uint8_t* v, __m512 levels,
                                                                                  __m512 scale) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)v), nibble = _mm_set1_epi8(15);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), levels), scale);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 bf16x16_to_f32_avx512(const uint16_t* v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)v)), 16));
}
// native_bf16: the CPU has AVX512_BF16's conversion (the one path that executes it).
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void put16_avx512(Out* out, __m512 x,
                                                                                          bool native_bf16) {
    if constexpr (sizeof(Out) == 2)
        _mm256_storeu_si256((__m256i*)out, native_bf16 ? bf16x16_avx512_bf16(x) : bf16x16_avx512(x));
    else
        _mm512_storeu_ps((float*)out, x);
}
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline size_t widen_avx512(
    const Matrix& m, size_t r, size_t c0, size_t c1, Out* out, bool native_bf16) {
    const size_t C = m.cols;
    size_t c = c0;
    switch (m.dtype) {
        case DType::bf16: {
            const uint16_t* v = static_cast<const uint16_t*>(m.data) + r * C;
            if constexpr (sizeof(Out) == 4)
                for (; c + 16 <= c1; c += 16) _mm512_storeu_ps((float*)out + (c - c0), bf16x16_to_f32_avx512(v + c));
            break;
        }
        case DType::int8: {
            const int8_t* v = static_cast<const int8_t*>(m.data) + r * C;
            const __m512 s = _mm512_set1_ps(m.scales()[r]);
            for (; c + 16 <= c1; c += 16) put16_avx512(out + (c - c0), int8x16_avx512(v + c, s), native_bf16);
            break;
        }
        case DType::nf4: {
            const size_t nb = nf4_blocks(C);
            const uint8_t* v = static_cast<const uint8_t*>(m.data) + r * nb * (nf4_block / 2);
            const float* s = m.scales() + r * nb;
            const __m512 levels = _mm512_loadu_ps(nf4_levels);
            for (; c + 16 <= c1; c += 16)
                put16_avx512(out + (c - c0), nf4x16_avx512(v + c / 2, levels, _mm512_set1_ps(s[c / nf4_block])),
                             native_bf16);
            break;
        }
        default: break;
    }
    return c;
}
}  // namespace vec
#endif

// Values [c0, c1) of row r of m widened, to fp32 (Out float) or bf16 bits (Out uint16_t); c0 a
// multiple of nf4_block: the vector path of this CPU (isa.hpp), then the scalar tail.
template <class Out>
inline void widen_row_range(const Matrix& m, size_t r, size_t c0, size_t c1, Out* out) {
    size_t c = c0;
    if (m.dtype == DType::bf16 && sizeof(Out) == 2) return widen_row_range_scalar(m, r, c0, c1, out);  // a copy
#if defined(ZOO_X86)
    switch (vector_isa()) {
        case VectorIsa::avx512_bf16: c = vec::widen_avx512(m, r, c0, c1, out, true); break;
        case VectorIsa::avx512: c = vec::widen_avx512(m, r, c0, c1, out, false); break;
        case VectorIsa::avx2: c = vec::widen_avx2(m, r, c0, c1, out); break;
        default: break;
    }
#endif
    if (c < c1) widen_row_range_scalar(m, r, c, c1, out + (c - c0));
}

// Rows [r0, r1) of m widened to fp32 (out: (r1 - r0) x cols), rows in parallel.
inline void widen_rows(const Matrix& m, int r0, int r1, float* out) {
#pragma omp parallel for schedule(static)
    for (int r = r0; r < r1; r++) widen_row_range(m, r, 0, m.cols, out + (size_t)(r - r0) * m.cols);
}

// The same as bf16 bits, for the bf16 products.
inline void widen_rows_bf16(const Matrix& m, int r0, int r1, uint16_t* out) {
#pragma omp parallel for schedule(static)
    for (int r = r0; r < r1; r++) widen_row_range(m, r, 0, m.cols, out + (size_t)(r - r0) * m.cols);
}

// Stores rows [r0, r0 + n) of an (rows, cols) matrix in format t from fp32 values w (n x cols),
// into the block at dst (storage_bytes(t, rows, cols) bytes). Rows are independent in every
// format, so a fused matrix (q|k|v) is stored tensor by tensor.
inline void store_rows(DType t, int rows, int cols, int r0, int n, const float* w, void* dst) {
    if (r0 < 0 || n < 0 || r0 + n > rows) throw std::invalid_argument("zoo: rows outside the stored matrix");
    uint8_t* base = static_cast<uint8_t*>(dst);
    float* scales = reinterpret_cast<float*>(base + align64(value_bytes(t, rows, cols)));
    const size_t C = cols;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        const size_t r = (size_t)r0 + i;
        const float* x = w + (size_t)i * C;
        switch (t) {
            case DType::f32:
                for (size_t c = 0; c < C; c++) reinterpret_cast<float*>(base)[r * C + c] = x[c];
                break;
            case DType::bf16:
                for (size_t c = 0; c < C; c++) reinterpret_cast<uint16_t*>(base)[r * C + c] = to_bf16(x[c]);
                break;
            case DType::int8: {
                float amax = 0.0f;
                for (size_t c = 0; c < C; c++) amax = std::fmax(amax, std::fabs(x[c]));
                const float s = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
                scales[r] = s;
                int8_t* q = reinterpret_cast<int8_t*>(base) + r * C;
                for (size_t c = 0; c < C; c++) q[c] = (int8_t)std::lrint(std::fmax(-127.0f, std::fmin(127.0f, x[c] * inv)));
                break;
            }
            case DType::nf4: {
                const size_t nb = nf4_blocks(C);
                uint8_t* q = base + r * nb * (nf4_block / 2);
                for (size_t b = 0; b < nb; b++) {
                    const size_t c0 = b * nf4_block, c1 = std::min(C, c0 + nf4_block);
                    float amax = 0.0f;
                    for (size_t c = c0; c < c1; c++) amax = std::fmax(amax, std::fabs(x[c]));
                    scales[r * nb + b] = amax;
                    const float inv = amax > 0 ? 1.0f / amax : 0.0f;
                    uint8_t codes[nf4_block];
                    for (size_t c = c0; c < c0 + nf4_block; c++) {
                        // The nearest level: how many midpoints between levels lie below v
                        // (a tie goes to the lower level). Level 7 is 0.0, for the padding.
                        const float v = c < c1 ? x[c] * inv : 0.0f;
                        int code = 0;
                        for (int l = 0; l < 15; l++) code += v > nf4_midpoints[l];
                        codes[c - c0] = (uint8_t)code;
                    }
                    for (size_t c = c0; c < c0 + nf4_block; c += 2)
                        q[c / 2] = uint8_t(codes[c - c0] | (codes[c - c0 + 1] << 4));
                }
                break;
            }
        }
    }
}

}  // namespace zoo
