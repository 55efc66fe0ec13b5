#include "kernels/gemv.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "kernels/bf16.hpp"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// The kernels this build has: each instruction set's intrinsics are compiled only where the
// compiler's flags allow them (a build without -march=native, or on ARM, has the plain ones).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define ZOO_GEMV_AVX512 1
#if defined(__AVX512BF16__)
#define ZOO_GEMV_AVX512_BF16 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define ZOO_GEMV_AVX2 1
#endif

// The loops over the rows of a block and of x have a few iterations known at compile time:
// unrolled, their accumulators stay in registers (an array indexed in a loop lives in memory).
#define ZOO_UNROLL _Pragma("GCC unroll 8")

namespace zoo {
namespace gemv {

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::avx2: return "avx2";
        case Isa::avx512: return "avx512";
        case Isa::avx512_bf16: return "avx512_bf16";
        default: return "scalar";
    }
}

Isa isa_named(const std::string& name) {
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
        if (name == isa_name(isa)) return isa;
    throw std::invalid_argument("zoo: instruction set '" + name + "' is unknown (scalar, avx2, avx512, avx512_bf16)");
}

std::vector<Isa> isas() {
    std::vector<Isa> out{Isa::scalar};
#if defined(ZOO_GEMV_AVX2) && (defined(__x86_64__) || defined(__i386__))
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back(Isa::avx2);
#endif
#if defined(ZOO_GEMV_AVX512)
    bool vnni = true;  // where the build uses it (the int8 kernel's)
#if defined(__AVX512VNNI__)
    vnni = __builtin_cpu_supports("avx512vnni");
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && vnni)
        out.push_back(Isa::avx512);
#endif
#if defined(ZOO_GEMV_AVX512_BF16)
    if (out.back() == Isa::avx512 && __builtin_cpu_supports("avx512bf16")) out.push_back(Isa::avx512_bf16);
#endif
    return out;
}

Isa best_isa() {
    static const Isa best = isas().back();
    return best;
}

namespace {

// x is copied once per product into the order and format the kernels read, zero-padded to whole
// blocks of 64 (an nf4 row's last block is padded with the level 0.0 in storage: quant.hpp), so
// the kernels need no tail on the x side.
//   f32:          fp32 values in their order
//   bf16:         bf16 bits in their order (the AVX512_BF16 dot products of bf16 and int8 W)
//   nf4_f32_g32:  each group of 32 values as its 16 even ones, then its 16 odd ones: an nf4
//                 byte holds values 2i (low nibble) and 2i + 1 (high), and the kernels split the
//                 nibbles of 16 bytes into one vector of each (AVX-512)
//   nf4_bf16_g64: the same by groups of 64, in bf16 (AVX512_BF16: 32 bytes a step)
//   nf4_f32_g16:  the same by groups of 16 (AVX2: 8 bytes a step)
//   i16:          16-bit integers q = round(x / s), s = max|x| / 32767 of the row, then the rows'
//                 scales s (a bf16 product of int8 W, every instruction set: int8 times int16
//                 multiply-adds in integers, no conversion of W to floats)
enum class Layout { f32, bf16, nf4_f32_g32, nf4_bf16_g64, nf4_f32_g16, i16 };

size_t padded(int K) { return ((size_t)K + 63) / 64 * 64; }

bool rounds_operands(Precision p, DType t) { return p == Precision::bf16 && t != DType::f32; }

Layout layout_for(DType t, Precision p, Isa isa) {
    const bool nf4 = t == DType::nf4;
    if (t == DType::int8 && rounds_operands(p, t)) return Layout::i16;
    switch (isa) {
        case Isa::avx512_bf16:
            if (rounds_operands(p, t)) return nf4 ? Layout::nf4_bf16_g64 : Layout::bf16;  // bf16 W here
            return nf4 ? Layout::nf4_f32_g32 : Layout::f32;
        case Isa::avx512: return nf4 ? Layout::nf4_f32_g32 : Layout::f32;
        case Isa::avx2: return nf4 ? Layout::nf4_f32_g16 : Layout::f32;
        default: return Layout::f32;
    }
}

int group_of(Layout l) {
    switch (l) {
        case Layout::nf4_f32_g32: return 32;
        case Layout::nf4_bf16_g64: return 64;
        case Layout::nf4_f32_g16: return 16;
        default: return 0;  // in order
    }
}

// The 16-bit operand's scales follow its M rows of Kp integers.
float* i16_scales(void* out, int M, size_t Kp) { return static_cast<float*>(out) + (size_t)M * Kp / 2; }

// x rounded to bf16, as bits and as the float they stand for: loops the compiler vectorizes (a
// NaN stays a NaN, as in to_bf16).
inline uint32_t bf16_rounded_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;
    return (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : rounded;
}
inline float bf16_rounded(float x) {
    const uint32_t u = bf16_rounded_bits(x);
    float y;
    std::memcpy(&y, &u, 4);
    return y;
}

// Row m of x into row m of out (Kp values, or Kp bf16 bits or 16-bit integers). It runs once per
// product on every thread that takes part (decode.cpp), so its loops are kept vectorizable: a
// division per value here once cost more than an nf4 product's sums.
void prepare(Layout layout, bool round, int M, const float* x, int ldx, int K, void* out) {
    const size_t Kp = padded(K);
    const int G = group_of(layout);
    for (int m = 0; m < M; m++) {
        const float* xr = x + (size_t)m * ldx;
        switch (layout) {
            case Layout::i16: {
                int16_t* o = static_cast<int16_t*>(out) + (size_t)m * Kp;
                float amax = 0.0f;
                for (int c = 0; c < K; c++) amax = std::max(amax, std::fabs(xr[c]));
                const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
                for (int c = 0; c < K; c++) {
                    const float v = std::nearbyint(xr[c] * inv);  // |v| <= 32767 but for rounding
                    o[c] = (int16_t)(int32_t)std::min(32767.0f, std::max(-32767.0f, v));
                }
                std::fill(o + K, o + Kp, (int16_t)0);
                i16_scales(out, M, Kp)[m] = amax / 32767.0f;
                break;
            }
            case Layout::bf16: {
                uint16_t* o = static_cast<uint16_t*>(out) + (size_t)m * Kp;
                to_bf16_row(xr, o, K);
                std::fill(o + K, o + Kp, (uint16_t)0);
                break;
            }
            case Layout::f32: {
                float* o = static_cast<float*>(out) + (size_t)m * Kp;
                if (round)
                    for (int c = 0; c < K; c++) o[c] = bf16_rounded(xr[c]);
                else
                    std::memcpy(o, xr, sizeof(float) * K);
                std::fill(o + K, o + Kp, 0.0f);
                break;
            }
            default: {  // the nf4 orders: each group's even values, then its odd ones
                const bool bits = layout == Layout::nf4_bf16_g64;
                float* of = static_cast<float*>(out) + (size_t)m * Kp;
                uint16_t* ob = static_cast<uint16_t*>(out) + (size_t)m * Kp;
                const int half = G / 2;
                for (size_t g0 = 0; g0 < Kp; g0 += G) {
                    if (g0 + G <= (size_t)K) {
                        const float* xg = xr + g0;
                        if (bits)
                            for (int i = 0; i < half; i++) {
                                ob[g0 + i] = (uint16_t)(bf16_rounded_bits(xg[2 * i]) >> 16);
                                ob[g0 + half + i] = (uint16_t)(bf16_rounded_bits(xg[2 * i + 1]) >> 16);
                            }
                        else if (round)
                            for (int i = 0; i < half; i++) {
                                of[g0 + i] = bf16_rounded(xg[2 * i]);
                                of[g0 + half + i] = bf16_rounded(xg[2 * i + 1]);
                            }
                        else
                            for (int i = 0; i < half; i++) {
                                of[g0 + i] = xg[2 * i];
                                of[g0 + half + i] = xg[2 * i + 1];
                            }
                        continue;
                    }
                    for (int i = 0; i < G; i++) {  // the group K ends in, or after
                        const size_t c = g0 + i, at = g0 + (i & 1) * half + i / 2;
                        const float v = c < (size_t)K ? (round || bits ? bf16_rounded(xr[c]) : xr[c]) : 0.0f;
                        if (bits)
                            ob[at] = (uint16_t)(bf16_rounded_bits(v) >> 16);
                        else
                            of[at] = v;
                    }
                }
            }
        }
    }
}

// Where the sums go: y = residual + bias + sum.
struct Out {
    float* y;
    int ldy;
    const float* bias;
    const float* residual;
    int ldr;
    void put(int m, int r, float sum) const {
        float base = residual ? residual[(size_t)m * ldr + r] : 0.0f;
        if (bias) base += bias[r];
        y[(size_t)m * ldy + r] = base + sum;
    }
};

// What every kernel reads: the matrix, x prepared (xop, rows Kp apart in its own units), the
// NF4 levels as this product uses them, and where the sums go.
struct Job {
    const Matrix* W;
    int M, K;
    size_t Kp;
    const void* xop;
    int x_bytes;             // of one prepared value: 4, or 2 in the bf16 and 16-bit layouts
    const float* x_scales;   // the 16-bit layout's, one per row of x
    float levels[16];
    uint16_t levels_bf16[16];
    Out out;
    const float* xf(int m) const { return static_cast<const float*>(xop) + (size_t)m * Kp; }
    const uint16_t* xb(int m) const { return static_cast<const uint16_t*>(xop) + (size_t)m * Kp; }
    const int16_t* xi(int m) const { return static_cast<const int16_t*>(xop) + (size_t)m * Kp; }
    size_t nf4_row_bytes() const { return nf4_blocks(K) * (nf4_block / 2); }
    // The same product for rows m0..m0+n-1 of x alone.
    Job rows_of_x(int m0, int n) const {
        Job g = *this;
        g.M = n;
        g.xop = static_cast<const uint8_t*>(xop) + (size_t)m0 * Kp * x_bytes;
        if (x_scales) g.x_scales += m0;
        g.out.y += (size_t)m0 * out.ldy;
        if (out.residual) g.out.residual += (size_t)m0 * out.ldr;
        return g;
    }
};

// Up to 4 rows of x go through a block of rows of W together; more go in a second group over
// the same block, which is then in cache: each group's x stays in L1 (8 rows of a 4096-wide x
// would not, and every block of W would read them all again from L2). The AVX-512 int8 and nf4
// kernels keep memory busy meanwhile (avx512::by_groups_ahead).
constexpr int x_group = 4;

// The 16-bit operand's integer sums go into float sums every this many values: a 32-bit lane
// then holds at most 128 products of pairs (2 x 127 x 32767 each), below 2^31.
constexpr int i16_flush = 2048;

// --- plain C++: every format, every machine --------------------------------------------

// int8 W against the 16-bit operand: exact integer sums, then the two scales.
void rows_scalar_i16(const Job& j, int r0, int r1) {
    const Matrix& W = *j.W;
    const int K = j.K;
    for (int r = r0; r < r1; r++) {
        const int8_t* w = static_cast<const int8_t*>(W.data) + (size_t)r * K;
        for (int m = 0; m < j.M; m++) {
            const int16_t* x = j.xi(m);
            int64_t sum = 0;
            for (int c = 0; c < K; c++) sum += (int32_t)w[c] * x[c];
            j.out.put(m, r, (float)((double)W.scales()[r] * j.x_scales[m] * (double)sum));
        }
    }
}

void rows_scalar(const Job& j, int r0, int r1) {
    const Matrix& W = *j.W;
    const int K = j.K;
    for (int r = r0; r < r1; r++)
        for (int m = 0; m < j.M; m++) {
            const float* x = j.xf(m);
            float sum = 0.0f;
            switch (W.dtype) {
                case DType::f32: {
                    const float* w = W.f32() + (size_t)r * K;
                    for (int c = 0; c < K; c++) sum += w[c] * x[c];
                    break;
                }
                case DType::bf16: {
                    const uint16_t* w = static_cast<const uint16_t*>(W.data) + (size_t)r * K;
                    for (int c = 0; c < K; c++) sum += from_bf16(w[c]) * x[c];
                    break;
                }
                case DType::int8: {
                    const int8_t* w = static_cast<const int8_t*>(W.data) + (size_t)r * K;
                    for (int c = 0; c < K; c++) sum += (float)w[c] * x[c];
                    sum *= W.scales()[r];
                    break;
                }
                case DType::nf4: {
                    const size_t nb = nf4_blocks(K);
                    const uint8_t* v = static_cast<const uint8_t*>(W.data) + r * j.nf4_row_bytes();
                    const float* s = W.scales() + (size_t)r * nb;
                    for (size_t b = 0; b < nb; b++) {
                        float block = 0.0f;
                        for (int i = 0; i < nf4_block; i += 2) {
                            const uint8_t byte = v[(b * nf4_block + i) / 2];
                            block += j.levels[byte & 15] * x[b * nf4_block + i] + j.levels[byte >> 4] * x[b * nf4_block + i + 1];
                        }
                        sum += s[b] * block;
                    }
                    break;
                }
            }
            j.out.put(m, r, sum);
        }
}

// Rows of W an AVX2 kernel takes together (each value of x loaded then feeds them all), by M:
// enough independent sums to keep the multiply-adds busy, few enough to stay in registers.
// (AVX-512's 32 registers take 4 rows against up to 4 rows of x.)
constexpr int rows_at_once(int M) { return M <= 2 ? 4 : 2; }  // AVX2's 16 registers

// --- AVX2 --------------------------------------------------------------------------------
#if defined(ZOO_GEMV_AVX2)
namespace avx2 {

inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 16 values of row r from column k, as two vectors of 8 that pair with x[k..k+8) and
// x[k+8..k+16) of the prepared operand (nf4: its group's even and odd values).
struct F32 {
    const float* w;
    int K;
    void load(int r, int k, __m256& a, __m256& b) const {
        const float* p = w + (size_t)r * K + k;
        a = _mm256_loadu_ps(p);
        b = _mm256_loadu_ps(p + 8);
    }
    float value(int r, int c) const { return w[(size_t)r * K + c]; }
};
struct BF16 {
    const uint16_t* w;
    int K;
    static __m256 widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
    void load(int r, int k, __m256& a, __m256& b) const {
        const uint16_t* p = w + (size_t)r * K + k;
        a = widen(_mm_loadu_si128((const __m128i*)p));
        b = widen(_mm_loadu_si128((const __m128i*)(p + 8)));
    }
    float value(int r, int c) const { return from_bf16(w[(size_t)r * K + c]); }
};
struct Int8 {
    const int8_t* w;
    int K;
    static __m256 widen(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    }
    void load(int r, int k, __m256& a, __m256& b) const {
        const int8_t* p = w + (size_t)r * K + k;
        a = widen(p);
        b = widen(p + 8);
    }
    float value(int r, int c) const { return (float)w[(size_t)r * K + c]; }
};
struct NF4 {
    const uint8_t* v;
    const float* scales;
    size_t row_bytes, blocks;
    __m256 low_levels, high_levels;  // levels 0-7 and 8-15
    __m256 lookup(__m256i idx) const {
        const __m256 a = _mm256_permutevar8x32_ps(low_levels, idx), b = _mm256_permutevar8x32_ps(high_levels, idx);
        return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));  // bit 3 picks the half
    }
    void load(int r, int k, __m256& a, __m256& b) const {
        const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(v + r * row_bytes + k / 2)));
        const __m256 s = _mm256_set1_ps(scales[r * blocks + k / nf4_block]);
        a = _mm256_mul_ps(lookup(_mm256_and_si256(codes, _mm256_set1_epi32(15))), s);
        b = _mm256_mul_ps(lookup(_mm256_srli_epi32(codes, 4)), s);
    }
};

// RB rows of W from row r against the M rows of x; columns [0, kv) by vectors, [kv, K) one at
// a time (value(r, c)); row_scale: int8's per-row scale.
template <int M, int RB, class F>
inline void block(const Job& j, const F& f, int r, int kv, bool int8) {
    __m256 acc[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) acc[i][m] = _mm256_setzero_ps();
    for (int k = 0; k < kv; k += 16) {
        __m256 a[RB], b[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) f.load(r + i, k, a[i], b[i]);
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            const float* x = j.xf(m) + k;
            const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) acc[i][m] = _mm256_fmadd_ps(b[i], x1, _mm256_fmadd_ps(a[i], x0, acc[i][m]));
        }
    }
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            float sum = hsum(acc[i][m]);
            if constexpr (!std::is_same_v<F, NF4>)
                for (int c = kv; c < j.K; c++) sum += f.value(r + i, c) * j.xf(m)[c];
            if (int8) sum *= j.W->scales()[r + i];
            j.out.put(m, r + i, sum);
        }
}

template <int M, class F>
void rows(const Job& j, const F& f, int r0, int r1, int kv, bool int8) {
    constexpr int G1 = M < x_group ? M : x_group, G2 = M - G1, RB = rows_at_once(G1);
    const Job first = j.rows_of_x(0, G1), second = j.rows_of_x(G1, G2);
    int r = r0;
    for (; r + RB <= r1; r += RB) {
        block<G1, RB>(first, f, r, kv, int8);
        if constexpr (G2 > 0) block<G2, RB>(second, f, r, kv, int8);
    }
    for (; r < r1; r++) {
        block<G1, 1>(first, f, r, kv, int8);
        if constexpr (G2 > 0) block<G2, 1>(second, f, r, kv, int8);
    }
}

template <int M>
void rows_m(const Job& j, int r0, int r1) {
    const Matrix& W = *j.W;
    const int K = j.K, kv = K / 16 * 16;
    switch (W.dtype) {
        case DType::f32: return rows<M>(j, F32{W.f32(), K}, r0, r1, kv, false);
        case DType::bf16: return rows<M>(j, BF16{static_cast<const uint16_t*>(W.data), K}, r0, r1, kv, false);
        case DType::int8: return rows<M>(j, Int8{static_cast<const int8_t*>(W.data), K}, r0, r1, kv, true);
        case DType::nf4:
            return rows<M>(j,
                           NF4{static_cast<const uint8_t*>(W.data), W.scales(), j.nf4_row_bytes(), nf4_blocks(K),
                               _mm256_loadu_ps(j.levels), _mm256_loadu_ps(j.levels + 8)},
                           r0, r1, (int)j.Kp, false);
    }
}

// int8 W against the 16-bit operand: 16 values a step widened to 16-bit integers, products of
// pairs added into 32-bit integer sums, which a float sum takes every i16_flush values (before
// they could overflow: 128 pairs of at most 2 x 127 x 32767 per lane).
template <int M, int RB>
inline void block_i16(const Job& j, int r) {
    const int8_t* w = static_cast<const int8_t*>(j.W->data);
    const int K = j.K, kv = K / 16 * 16;
    __m256 sums[RB][M];
    __m256i ints[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) sums[i][m] = _mm256_setzero_ps(), ints[i][m] = _mm256_setzero_si256();
    auto flush = [&] {
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            ZOO_UNROLL
            for (int m = 0; m < M; m++) {
                sums[i][m] = _mm256_add_ps(sums[i][m], _mm256_cvtepi32_ps(ints[i][m]));
                ints[i][m] = _mm256_setzero_si256();
            }
    };
    for (int k0 = 0; k0 < kv; k0 += i16_flush) {  // the flushes outside the loop that multiplies
        const int k1 = std::min(kv, k0 + i16_flush);
        for (int k = k0; k < k1; k += 16) {
            __m256i wv[RB];
            ZOO_UNROLL
            for (int i = 0; i < RB; i++)
                wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (size_t)(r + i) * K + k)));
            ZOO_UNROLL
            for (int m = 0; m < M; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(j.xi(m) + k));
                ZOO_UNROLL
                for (int i = 0; i < RB; i++)
                    ints[i][m] = _mm256_add_epi32(ints[i][m], _mm256_madd_epi16(wv[i], xv));
            }
        }
        flush();
    }
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            int64_t tail = 0;
            for (int c = kv; c < K; c++) tail += (int32_t)w[(size_t)(r + i) * K + c] * j.xi(m)[c];
            const float sum = hsum(sums[i][m]) + (float)tail;
            j.out.put(m, r + i, j.W->scales()[r + i] * j.x_scales[m] * sum);
        }
}

template <int M>
void rows_i16_m(const Job& j, int r0, int r1) {
    constexpr int G1 = M < x_group ? M : x_group, G2 = M - G1, RB = rows_at_once(G1);
    const Job first = j.rows_of_x(0, G1), second = j.rows_of_x(G1, G2);
    int r = r0;
    for (; r + RB <= r1; r += RB) {
        block_i16<G1, RB>(first, r);
        if constexpr (G2 > 0) block_i16<G2, RB>(second, r);
    }
    for (; r < r1; r++) {
        block_i16<G1, 1>(first, r);
        if constexpr (G2 > 0) block_i16<G2, 1>(second, r);
    }
}

}  // namespace avx2
#endif

// --- AVX-512 -------------------------------------------------------------------------------
#if defined(ZOO_GEMV_AVX512)
namespace avx512 {

inline __mmask16 tail16(int n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
inline __mmask32 tail32(int n) { return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1); }

// Each row of a block is its own stream through memory. The int8 and nf4 kernels read a row's
// next line from DRAM sooner when they ask for it prefetch_bytes ahead themselves (a matrix far
// larger than the caches, one thread: int8 about 15% more bytes a second, nf4 20-30%); the bf16
// one, which reads a whole line per step, gains nothing from it and is left to the hardware.
constexpr int prefetch_bytes = 1024;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + prefetch_bytes, _MM_HINT_T0); }

// Four sums at once: {sum a, sum b, sum c, sum d}.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    auto half = [](__m512 v) {
        return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    };
    const __m256 ab = _mm256_hadd_ps(half(a), half(b)), cd = _mm256_hadd_ps(half(c), half(d));
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // {a, b, c, d} sums of each 128-bit half
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// 32 values of row r from column k as two fp32 vectors pairing with x[k..k+16) and
// x[k+16..k+32) of the prepared operand; load_tail the same for the n < 32 left in the row.
struct F32 {
    const float* w;
    int K;
    void load(int r, int k, __m512& a, __m512& b) const {
        const float* p = w + (size_t)r * K + k;
        a = _mm512_loadu_ps(p);
        b = _mm512_loadu_ps(p + 16);
    }
    void load_tail(int r, int k, int n, __m512& a, __m512& b) const {
        const float* p = w + (size_t)r * K + k;
        a = _mm512_maskz_loadu_ps(tail16(n), p);
        b = _mm512_maskz_loadu_ps(tail16(n - 16), p + 16);
    }
};
struct BF16 {
    const uint16_t* w;
    int K;
    static __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
    void load(int r, int k, __m512& a, __m512& b) const {
        const uint16_t* p = w + (size_t)r * K + k;
        a = widen(_mm256_loadu_si256((const __m256i*)p));
        b = widen(_mm256_loadu_si256((const __m256i*)(p + 16)));
    }
    void load_tail(int r, int k, int n, __m512& a, __m512& b) const {
        const uint16_t* p = w + (size_t)r * K + k;
        a = widen(_mm256_maskz_loadu_epi16(tail16(n), p));
        b = widen(_mm256_maskz_loadu_epi16(tail16(n - 16), p + 16));
    }
};
struct Int8 {
    const int8_t* w;
    int K;
    static __m512 widen(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
    void load(int r, int k, __m512& a, __m512& b) const {
        const int8_t* p = w + (size_t)r * K + k;
        a = widen(_mm_loadu_si128((const __m128i*)p));
        b = widen(_mm_loadu_si128((const __m128i*)(p + 16)));
    }
    void load_tail(int r, int k, int n, __m512& a, __m512& b) const {
        const int8_t* p = w + (size_t)r * K + k;
        a = widen(_mm_maskz_loadu_epi8(tail16(n), p));
        b = widen(_mm_maskz_loadu_epi8(tail16(n - 16), p + 16));
    }
};
struct NF4 {  // 16 bytes: the group's 16 even values (low nibbles), then its 16 odd ones
    const uint8_t* v;
    const float* scales;
    size_t row_bytes, blocks;
    __m512 levels;
    void load(int r, int k, __m512& a, __m512& b) const {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(v + r * row_bytes + k / 2)));
        const __m512 s = _mm512_set1_ps(scales[r * blocks + k / nf4_block]);
        a = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), levels), s);
        b = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), levels), s);
    }
    void load_tail(int, int, int, __m512&, __m512&) const {}  // rows are whole blocks: never called
};

// fp32 multiply-adds: RB rows from r against the M rows of x. With few sums (RB * M <= 4)
// each keeps two accumulators, so that enough multiply-adds are in flight.
template <int M, int RB, class F>
inline void block_fma(const Job& j, const F& f, int r, int kv, bool int8) {
    constexpr bool two = RB * M <= 4;
    __m512 acc[RB][M], acc2[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) acc[i][m] = acc2[i][m] = _mm512_setzero_ps();
    auto step = [&](const __m512* a, const __m512* b, int k) {
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            const float* x = j.xf(m) + k;
            const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) {
                acc[i][m] = _mm512_fmadd_ps(a[i], x0, acc[i][m]);
                if (two) acc2[i][m] = _mm512_fmadd_ps(b[i], x1, acc2[i][m]);
                else acc[i][m] = _mm512_fmadd_ps(b[i], x1, acc[i][m]);
            }
        }
    };
    int k = 0;
    for (; k < kv; k += 32) {
        __m512 a[RB], b[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) f.load(r + i, k, a[i], b[i]);
        step(a, b, k);
    }
    if (k < j.K && !std::is_same_v<F, NF4>) {
        __m512 a[RB], b[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) f.load_tail(r + i, k, j.K - k, a[i], b[i]);
        step(a, b, k);
    }
    ZOO_UNROLL
    for (int m = 0; m < M; m++) {
        float sums[RB];
        if constexpr (RB == 4) {
            _mm_storeu_ps(sums, sum4(_mm512_add_ps(acc[0][m], acc2[0][m]), _mm512_add_ps(acc[1][m], acc2[1][m]),
                                     _mm512_add_ps(acc[2][m], acc2[2][m]), _mm512_add_ps(acc[3][m], acc2[3][m])));
        } else {
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][m], acc2[i][m]));
        }
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) j.out.put(m, r + i, int8 ? sums[i] * j.W->scales()[r + i] : sums[i]);
    }
}

template <int M, class F>
void rows_fma(const Job& j, const F& f, int r0, int r1, int kv, bool int8) {
    constexpr int G1 = M < x_group ? M : x_group, G2 = M - G1, RB = 4;
    const Job first = j.rows_of_x(0, G1), second = j.rows_of_x(G1, G2);
    int r = r0;
    for (; r + RB <= r1; r += RB) {
        block_fma<G1, RB>(first, f, r, kv, int8);
        if constexpr (G2 > 0) block_fma<G2, RB>(second, f, r, kv, int8);
    }
    for (; r < r1; r++) {
        block_fma<G1, 1>(first, f, r, kv, int8);
        if constexpr (G2 > 0) block_fma<G2, 1>(second, f, r, kv, int8);
    }
}

template <int M>
void rows_m(const Job& j, int r0, int r1) {
    const Matrix& W = *j.W;
    const int K = j.K, kv = K / 32 * 32;
    switch (W.dtype) {
        case DType::f32: return rows_fma<M>(j, F32{W.f32(), K}, r0, r1, kv, false);
        case DType::bf16: return rows_fma<M>(j, BF16{static_cast<const uint16_t*>(W.data), K}, r0, r1, kv, false);
        case DType::int8: return rows_fma<M>(j, Int8{static_cast<const int8_t*>(W.data), K}, r0, r1, kv, true);
        case DType::nf4:
            return rows_fma<M>(j,
                               NF4{static_cast<const uint8_t*>(W.data), W.scales(), j.nf4_row_bytes(), nf4_blocks(K),
                                   _mm512_loadu_ps(j.levels)},
                               r0, r1, (int)j.Kp, false);
    }
}

// The groups of x against blocks of RB rows (see x_group), for any of the block kernels.
template <int M, int RB, class Block>
void by_groups(const Job& j, int r0, int r1, const Block& block) {
    constexpr int G1 = M < x_group ? M : x_group, G2 = M - G1;
    const Job first = j.rows_of_x(0, G1), second = j.rows_of_x(G1, G2);
    int r = r0;
    for (; r + RB <= r1; r += RB) {
        block(first, r, std::integral_constant<int, G1>(), std::integral_constant<int, RB>());
        if constexpr (G2 > 0) block(second, r, std::integral_constant<int, G2>(), std::integral_constant<int, RB>());
    }
    for (; r < r1; r++) {
        block(first, r, std::integral_constant<int, G1>(), std::integral_constant<int, 1>());
        if constexpr (G2 > 0) block(second, r, std::integral_constant<int, G2>(), std::integral_constant<int, 1>());
    }
}

// Against 5 to 8 rows of x, a block of W goes through twice (by_groups): group 1 reads it from
// memory, group 2 from the caches, where it asks for nothing. So the block's lines are asked for
// a block ahead, half by each pass: while the two passes over block b run, the lines of block
// b + 1 come in (rows 0..RB/2-1 during group 1's pass, the rest during group 2's), and memory
// is busy the whole time instead of half of it. What each pass asks for: PF rows from `at`,
// `stride` bytes apart, at the byte `at + k` of each when the pass is at byte k of its own rows.
constexpr int ahead_locality = 3;  // __builtin_prefetch's: 3 = into L1 (T0), 2 = L2 (T1)
template <int PF>
struct Ahead {
    const char* at;
    size_t stride;
    // Inlined always: GCC 12 otherwise takes a function that only prefetches for one without
    // effects (ipa-pure-const) and drops its calls.
    __attribute__((always_inline)) void operator()(size_t k) const {
        ZOO_UNROLL
        for (int i = 0; i < PF; i++) row(i, k);
    }
    __attribute__((always_inline)) void row(int i, size_t k) const {  // the i-th alone (none past PF)
        if (i < PF) __builtin_prefetch(at + i * stride + k, 0, ahead_locality);
    }
};

// by_groups for M > x_group, each pass handed what it asks for ahead (row_bytes: a row of W's
// stored values from base). The chunk's first block has nobody ahead of it: group 1 asks for its
// own lines prefetch_bytes ahead, as the one-group kernels do, and group 2 for all of the next
// block. The last block asks again for rows of its own or of the rows left (the chunk's rows
// after it belong to whichever thread takes them).
template <int M, int RB, class Block>
void by_groups_ahead(const Job& j, int r0, int r1, const void* base, size_t row_bytes, const Block& block) {
    static_assert(M > x_group && RB % 2 == 0, "two groups of x, a block of W in two halves");
    constexpr int G1 = x_group, G2 = M - G1, H = RB / 2;
    using g1 = std::integral_constant<int, G1>;
    using g2 = std::integral_constant<int, G2>;
    using rb = std::integral_constant<int, RB>;
    using one = std::integral_constant<int, 1>;
    const Job first = j.rows_of_x(0, G1), second = j.rows_of_x(G1, G2);
    auto row = [&](int r) { return static_cast<const char*>(base) + (size_t)r * row_bytes; };
    int r = r0;
    if (r + RB <= r1) {
        const int next = std::min(r + RB, r1 - RB);
        block(first, r, g1(), rb(), Ahead<RB>{row(r) + prefetch_bytes, row_bytes});
        block(second, r, g2(), rb(), Ahead<RB>{row(next), row_bytes});
        for (r += RB; r + RB <= r1; r += RB) {
            const int after = std::min(r + RB, r1 - RB);
            block(first, r, g1(), rb(), Ahead<H>{row(after), row_bytes});
            block(second, r, g2(), rb(), Ahead<H>{row(after + H), row_bytes});
        }
    }
    for (; r < r1; r++) {
        block(first, r, g1(), one(), Ahead<1>{row(r) + prefetch_bytes, row_bytes});
        block(second, r, g2(), one(), Ahead<0>{nullptr, 0});
    }
}

// The dot-product instructions, written out: GCC 12 gives each intrinsic's sum a register of its
// own and copies it in and back around every step of a loop (in the int8 kernel against 4 rows
// of x: 24 copies and 4 trips to the stack a step of 32 dot products), where the instruction
// adds into its register in place. The second operand may be read from memory directly.
#if defined(__AVX512VNNI__)
inline __m512i dpwssd(__m512i sum, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "vm"(b));
    return sum;
}
#endif

// int8 W against the 16-bit operand, 32 values a step (see the AVX2 kernel); AVX512_VNNI adds
// the pairs' products into the integer sums in one instruction.
inline __m512i add_pair_products(__m512i sum, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return dpwssd(sum, w, x);
#else
    return _mm512_add_epi32(sum, _mm512_madd_epi16(w, x));
#endif
}

// Against one or two rows of x (8 rows of W: 16 sums in registers, 8 widened rows).
template <int M, int RB>
inline void block_i16_few(const Job& j, int r) {
    const int8_t* w = static_cast<const int8_t*>(j.W->data);
    const int K = j.K;
    __m512 sums[RB][M];
    __m512i ints[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) sums[i][m] = _mm512_setzero_ps(), ints[i][m] = _mm512_setzero_si512();
    auto flush = [&] {
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            ZOO_UNROLL
            for (int m = 0; m < M; m++) {
                sums[i][m] = _mm512_add_ps(sums[i][m], _mm512_cvtepi32_ps(ints[i][m]));
                ints[i][m] = _mm512_setzero_si512();
            }
    };
    auto step = [&](const __m512i* wv, int k) {
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            const __m512i xv = _mm512_loadu_si512(j.xi(m) + k);
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) ints[i][m] = add_pair_products(ints[i][m], wv[i], xv);
        }
    };
    const int kv = K / 32 * 32;
    int k = 0;
    for (int k0 = 0; k0 < kv; k0 += i16_flush) {  // the flushes outside the loop that multiplies
        const int k1 = std::min(kv, k0 + i16_flush);
        for (k = k0; k < k1; k += 32) {
            __m512i wv[RB];
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) {
                const int8_t* p = w + (size_t)(r + i) * K + k;
                if (!(k & 63)) prefetch(p);
                wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
            }
            step(wv, k);
        }
        flush();
    }
    k = kv;
    if (k < K) {  // the operand is zero past K
        __m512i wv[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            wv[i] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail32(K - k), w + (size_t)(r + i) * K + k));
        step(wv, k);
    }
    flush();
    ZOO_UNROLL
    for (int m = 0; m < M; m++) {
        float s[RB];
        if constexpr (RB == 4) _mm_storeu_ps(s, sum4(sums[0][m], sums[1][m], sums[2][m], sums[3][m]));
        else
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) s[i] = _mm512_reduce_add_ps(sums[i][m]);
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) j.out.put(m, r + i, j.W->scales()[r + i] * j.x_scales[m] * s[i]);
    }
}

// A 512-bit lane adds a pair of products per 32 values, so its integer sum takes 256 pairs
// before a flush: 256 x 2 x 128 x 32767 < 2^31 (-128 in a loaded file included). The float sums
// take the integer ones at most once per flush, so they live in memory: the RB x M integer sums,
// W's widened rows and x's vector then have the 32 registers.
constexpr int i16_flush_many = 8192;

template <int M, int RB, class A>
inline void block_i16_many(const Job& j, int r, const A& ahead) {
    const int8_t* w = static_cast<const int8_t*>(j.W->data);
    const int K = j.K;
    alignas(64) float sums[RB][M][16] = {};
    __m512i ints[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) ints[i][m] = _mm512_setzero_si512();
    auto flush = [&] {
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            ZOO_UNROLL
            for (int m = 0; m < M; m++) {
                _mm512_store_ps(sums[i][m], _mm512_add_ps(_mm512_load_ps(sums[i][m]), _mm512_cvtepi32_ps(ints[i][m])));
                ints[i][m] = _mm512_setzero_si512();
            }
    };
    auto step = [&](const __m512i* wv, int k) {
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            const __m512i xv = _mm512_loadu_si512(j.xi(m) + k);
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) ints[i][m] = add_pair_products(ints[i][m], wv[i], xv);
        }
    };
    auto load = [&](int k) {  // 32 values of each row, widened
        __m512i wv[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + (size_t)(r + i) * K + k)));
        step(wv, k);
    };
    // A whole line of each row a turn (one prefetch each, no branch in the loop: with one, GCC
    // moves the 16 sums between registers on every step, 1.2-1.4x slower).
    const int k64 = K / 64 * 64, kv = K / 32 * 32;
    int k = 0;
    for (int k0 = 0; k0 < k64; k0 += i16_flush_many) {  // the flushes outside the loop that multiplies
        const int k1 = std::min(k64, k0 + i16_flush_many);
        for (k = k0; k < k1; k += 64) {
            ahead((size_t)k);
            load(k);
            load(k + 32);
        }
        flush();
    }
    k = k64;
    if (k < kv) load(k), k += 32;
    if (k < K) {  // the operand is zero past K
        __m512i wv[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++)
            wv[i] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail32(K - k), w + (size_t)(r + i) * K + k));
        step(wv, k);
    }
    flush();
    ZOO_UNROLL
    for (int m = 0; m < M; m++) {
        float s[RB];
        if constexpr (RB == 4)
            _mm_storeu_ps(s, sum4(_mm512_load_ps(sums[0][m]), _mm512_load_ps(sums[1][m]), _mm512_load_ps(sums[2][m]),
                                  _mm512_load_ps(sums[3][m])));
        else
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) s[i] = _mm512_reduce_add_ps(_mm512_load_ps(sums[i][m]));
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) j.out.put(m, r + i, j.W->scales()[r + i] * j.x_scales[m] * s[i]);
    }
}

// One or two rows of x against 8 rows of W at a time: twice the rows streaming from memory at
// once, which a single thread reads about 8% faster from DRAM than 4. More rows of x: groups of 4
// against 4 rows of W (16 integer sums; a group of 8 against 2 rows was slower).
template <int M>
void rows_i16_m(const Job& j, int r0, int r1) {
    if constexpr (M <= 2)
        by_groups<M, 8>(j, r0, r1, [&](const Job& g, int r, auto m, auto rb) {
            block_i16_few<decltype(m)::value, decltype(rb)::value>(g, r);
        });
    else if constexpr (M <= x_group)
        by_groups<M, 4>(j, r0, r1, [&](const Job& g, int r, auto m, auto rb) {
            constexpr int RB = decltype(rb)::value;
            const char* own = reinterpret_cast<const char*>(static_cast<const int8_t*>(j.W->data) + (size_t)r * j.K);
            block_i16_many<decltype(m)::value, RB>(g, r, Ahead<RB>{own + prefetch_bytes, (size_t)j.K});
        });
    else
        by_groups_ahead<M, 4>(j, r0, r1, j.W->data, (size_t)j.K, [&](const Job& g, int r, auto m, auto rb, auto ahead) {
            block_i16_many<decltype(m)::value, decltype(rb)::value>(g, r, ahead);
        });
}

#if defined(ZOO_GEMV_AVX512_BF16)
inline __m512 dpbf16(__m512 sum, __m512bh a, __m512bh b) {  // written out: see dpwssd
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(sum) : "v"(a), "vm"(b));
    return sum;
}

// bf16 dot products (a bf16 product of a matrix stored narrower than fp32): 32 values of a row
// as bf16 against 32 of x, pairs summed into 16 fp32 lanes.
struct BF16Dot {
    const uint16_t* w;
    int K;
    __m512bh load(int r, int k) const { return (__m512bh)_mm512_loadu_si512(w + (size_t)r * K + k); }
    void prefetch(int, int) const {}
    __m512bh load_tail(int r, int k, int n) const {
        return (__m512bh)_mm512_maskz_loadu_epi16(tail32(n), w + (size_t)r * K + k);
    }
};
struct Int8Dot {  // int8 values are exact in bf16 (8 significant bits)
    const int8_t* w;
    int K;
    static __m512bh widen(__m256i q) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
    __m512bh load(int r, int k) const { return widen(_mm256_loadu_si256((const __m256i*)(w + (size_t)r * K + k))); }
    void prefetch(int r, int k) const {
        if (!(k & 63)) avx512::prefetch(w + (size_t)r * K + k);
    }
    __m512bh load_tail(int r, int k, int n) const {
        return widen(_mm256_maskz_loadu_epi8(tail32(n), w + (size_t)r * K + k));
    }
};

template <int M, int RB, class F>
inline void block_dot(const Job& j, const F& f, int r, int kv, bool int8) {
    __m512 acc[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    auto step = [&](const __m512bh* w, int k) {
        ZOO_UNROLL
        for (int m = 0; m < M; m++) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(j.xb(m) + k);
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) acc[i][m] = dpbf16(acc[i][m], w[i], x);
        }
    };
    int k = 0;
    for (; k < kv; k += 32) {
        __m512bh w[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) {
            f.prefetch(r + i, k);
            w[i] = f.load(r + i, k);
        }
        step(w, k);
    }
    if (k < j.K) {
        __m512bh w[RB];
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) w[i] = f.load_tail(r + i, k, j.K - k);
        step(w, k);
    }
    ZOO_UNROLL
    for (int m = 0; m < M; m++) {
        float sums[RB];
        if constexpr (RB == 4) _mm_storeu_ps(sums, sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
        else
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) sums[i] = _mm512_reduce_add_ps(acc[i][m]);
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) j.out.put(m, r + i, int8 ? sums[i] * j.W->scales()[r + i] : sums[i]);
    }
}

// nf4 by blocks of 64: 32 bytes, their low nibbles (the even values) and high nibbles (the odd
// ones) looked up among the 16 levels in bf16, two dot products, then the block's scale.
template <int M, int RB, class A>
inline void block_nf4_dot(const Job& j, int r, __m512i table, const A& ahead) {
    const uint8_t* v = static_cast<const uint8_t*>(j.W->data);
    const float* scales = j.W->scales();
    const size_t row_bytes = j.nf4_row_bytes(), blocks = nf4_blocks(j.K);
    __m512 acc[RB][M];
    ZOO_UNROLL
    for (int i = 0; i < RB; i++)
        ZOO_UNROLL
        for (int m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        const size_t k = b * nf4_block;
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) {
            const uint8_t* p = v + (r + i) * row_bytes + k / 2;
            if (!(b & 1)) ahead.row(i, k / 2);
            const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
            const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(codes, _mm512_set1_epi16(15)), table);
            const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
            const __m512 s = _mm512_set1_ps(scales[(r + i) * blocks + b]);
            ZOO_UNROLL
            for (int m = 0; m < M; m++) {
                const uint16_t* x = j.xb(m) + k;
                __m512 t = dpbf16(_mm512_setzero_ps(), even, (__m512bh)_mm512_loadu_si512(x));
                t = dpbf16(t, odd, (__m512bh)_mm512_loadu_si512(x + 32));
                acc[i][m] = _mm512_fmadd_ps(t, s, acc[i][m]);
            }
        }
    }
    ZOO_UNROLL
    for (int m = 0; m < M; m++) {
        float sums[RB];
        if constexpr (RB == 4) _mm_storeu_ps(sums, sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
        else
            ZOO_UNROLL
            for (int i = 0; i < RB; i++) sums[i] = _mm512_reduce_add_ps(acc[i][m]);
        ZOO_UNROLL
        for (int i = 0; i < RB; i++) j.out.put(m, r + i, sums[i]);
    }
}

template <int M>
void rows_dot_m(const Job& j, int r0, int r1) {
    const Matrix& W = *j.W;
    const int K = j.K, kv = K / 32 * 32;
    if (W.dtype == DType::nf4) {
        const __m512i table = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)j.levels_bf16));
        const size_t row_bytes = j.nf4_row_bytes();
        if constexpr (M <= x_group)
            by_groups<M, 4>(j, r0, r1, [&](const Job& g, int r, auto m, auto rb) {
                constexpr int RB = decltype(rb)::value;
                const char* own = static_cast<const char*>(W.data) + (size_t)r * row_bytes;
                block_nf4_dot<decltype(m)::value, RB>(g, r, table, Ahead<RB>{own + prefetch_bytes, row_bytes});
            });
        else
            by_groups_ahead<M, 4>(j, r0, r1, W.data, row_bytes, [&](const Job& g, int r, auto m, auto rb, auto ahead) {
                block_nf4_dot<decltype(m)::value, decltype(rb)::value>(g, r, table, ahead);
            });
    } else if (W.dtype == DType::int8) {
        const Int8Dot f{static_cast<const int8_t*>(W.data), K};
        by_groups<M, 4>(j, r0, r1, [&](const Job& g, int r, auto m, auto rb) {
            block_dot<decltype(m)::value, decltype(rb)::value>(g, f, r, kv, true);
        });
    } else {
        const BF16Dot f{static_cast<const uint16_t*>(W.data), K};
        by_groups<M, 4>(j, r0, r1, [&](const Job& g, int r, auto m, auto rb) {
            block_dot<decltype(m)::value, decltype(rb)::value>(g, f, r, kv, false);
        });
    }
}
#endif  // ZOO_GEMV_AVX512_BF16

}  // namespace avx512
#endif  // ZOO_GEMV_AVX512

using RowsFn = void (*)(const Job&, int, int);

template <template <int> class Table>
RowsFn by_m(int M) {
    switch (M) {
        case 1: return Table<1>::fn;
        case 2: return Table<2>::fn;
        case 3: return Table<3>::fn;
        case 4: return Table<4>::fn;
        case 5: return Table<5>::fn;
        case 6: return Table<6>::fn;
        case 7: return Table<7>::fn;
        default: return Table<8>::fn;
    }
}
#if defined(ZOO_GEMV_AVX2)
template <int M> struct Avx2Rows { static constexpr RowsFn fn = avx2::rows_m<M>; };
#endif
#if defined(ZOO_GEMV_AVX2)
template <int M> struct Avx2I16Rows { static constexpr RowsFn fn = avx2::rows_i16_m<M>; };
#endif
#if defined(ZOO_GEMV_AVX512)
template <int M> struct Avx512Rows { static constexpr RowsFn fn = avx512::rows_m<M>; };
template <int M> struct Avx512I16Rows { static constexpr RowsFn fn = avx512::rows_i16_m<M>; };
#endif
#if defined(ZOO_GEMV_AVX512_BF16)
template <int M> struct Avx512DotRows { static constexpr RowsFn fn = avx512::rows_dot_m<M>; };
#endif

RowsFn kernel_for(Layout layout, Isa isa, int M) {
    if (layout == Layout::i16) switch (isa) {
#if defined(ZOO_GEMV_AVX512)
            case Isa::avx512_bf16:
            case Isa::avx512: return by_m<Avx512I16Rows>(M);
#endif
#if defined(ZOO_GEMV_AVX2)
            case Isa::avx2: return by_m<Avx2I16Rows>(M);
#endif
            default: return rows_scalar_i16;
        }
    switch (isa) {
#if defined(ZOO_GEMV_AVX512_BF16)
        case Isa::avx512_bf16:
            if (layout == Layout::bf16 || layout == Layout::nf4_bf16_g64) return by_m<Avx512DotRows>(M);
            return by_m<Avx512Rows>(M);
#endif
#if defined(ZOO_GEMV_AVX512)
        case Isa::avx512: return by_m<Avx512Rows>(M);
#endif
#if defined(ZOO_GEMV_AVX2)
        case Isa::avx2: return by_m<Avx2Rows>(M);
#endif
        default: return rows_scalar;
    }
}

// Products smaller than this run on the calling thread: waking the others costs more.
constexpr size_t parallel_bytes = 128 << 10;

}  // namespace

size_t scratch_floats(int M, int K) { return (size_t)M * padded(K); }

Operand prepare(Precision p, int M, const float* x, int ldx, const Matrix& W, float* scratch, Isa isa) {
    if (M < 1 || M > max_rows)
        throw std::invalid_argument("zoo: a decode product takes 1 to " + std::to_string(max_rows) + " rows, not " +
                                    std::to_string(M));
    static const std::vector<Isa> have = isas();
    if (std::find(have.begin(), have.end(), isa) == have.end())
        throw std::invalid_argument(std::string("zoo: instruction set ") + isa_name(isa) +
                                    " is not built into this zoo or not supported by this CPU");
    const Layout layout = layout_for(W.dtype, p, isa);
    const bool round = rounds_operands(p, W.dtype);
    prepare(layout, round, M, x, ldx, W.cols, scratch);
    Operand op{isa, W.dtype, (int)layout, M, W.cols, padded(W.cols), scratch, {}, {}};
    for (int l = 0; l < 16; l++) {
        op.levels_bf16[l] = to_bf16(nf4_levels[l]);
        op.levels[l] = round ? from_bf16(op.levels_bf16[l]) : nf4_levels[l];
    }
    return op;
}

void rows(const Operand& x, const Matrix& W, int r0, int r1, const float* bias, const float* residual, int ldr,
          float* y, int ldy) {
    if (r0 >= r1) return;
    const Layout layout = (Layout)x.layout;
    const bool narrow = layout == Layout::bf16 || layout == Layout::nf4_bf16_g64 || layout == Layout::i16;
    const float* x_scales = layout == Layout::i16 ? i16_scales(const_cast<void*>(x.data), x.M, x.Kp) : nullptr;
    Job j{&W, x.M, x.K, x.Kp, x.data, narrow ? 2 : 4, x_scales, {}, {}, Out{y, ldy, bias, residual, ldr}};
    std::memcpy(j.levels, x.levels, sizeof(j.levels));
    std::memcpy(j.levels_bf16, x.levels_bf16, sizeof(j.levels_bf16));
    kernel_for(layout, x.isa, x.M)(j, r0, r1);
}

bool worth_threads(const Matrix& W) { return value_bytes(W.dtype, W.rows, W.cols) >= parallel_bytes; }

void product(Precision p, int M, const float* x, int ldx, const Matrix& W, const float* bias, const float* residual,
             int ldr, float* y, int ldy, float* scratch, Isa isa, bool parallel) {
    const Operand op = prepare(p, M, x, ldx, W, scratch, isa);
    std::atomic<int> next{0};
#pragma omp parallel if (parallel && worth_threads(W))
    {
        take_rows(next, W.rows, omp_get_num_threads(),
                  [&](int r0, int r1) { rows(op, W, r0, r1, bias, residual, ldr, y, ldy); });
    }
}

}  // namespace gemv
}  // namespace zoo
