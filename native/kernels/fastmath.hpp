// exp for float that compilers vectorize: the libm call in a loop stays scalar, and the
// activations, softmax and cross-entropy spend most of their time in exp. Cody-Waite range
// reduction x = n ln2 + r, |r| <= ln2/2, then the Cephes minimax polynomial; about 1 ulp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace zoo {

inline float fast_exp(float x) {
    // Clamped to [-87, 87]: 2^n stays a normal float, and so does 1 / (1 + e^87) = 1.6e-38, so a
    // saturated sigmoid (and the GELU and SiLU built on it) yields no denormal, which CPUs handle
    // on a slow path (a saturated GELU 2x slower on Zen 5). Two clamps, not one nested select:
    // tuned for Sapphire Rapids, GCC 13 and 14 split that one into masked paths per range (the
    // GELU forward 2x slower).
    x = x > 87.0f ? 87.0f : x;
    x = x < -87.0f ? -87.0f : x;
    float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

// The logistic function. Its own function so that Clad takes its derivative in the stable
// form s (1 - s) (below) rather than by the quotient rule, whose (1 + e^-z)^2 overflows to
// inf / inf = NaN in the saturated tail.
inline float sigmoid(float z) { return 1.0f / (1.0f + fast_exp(-z)); }

// tanh from fast_exp, so its loops vectorize (the soft-caps of Gemma 2's scores and logits run
// it over every score and logit): 1 - 2 / (1 + e^2x), exact at the saturated ends; near 0 its
// absolute error is a few float32 ulps of 1 (about 1e-7), as the softmax after it rounds.
inline float fast_tanh(float x) { return 1.0f - 2.0f / (1.0f + fast_exp(2.0f * x)); }

// The standard normal distribution function Phi(x) = erfc(-x / sqrt 2) / 2, in a form that
// vectorizes (libm's erf stays a scalar call: GPT-NeoX's exact GELU ran 13x slower than GPT-2's
// tanh one). erfc(z), z >= 0, is t exp(-z^2 + P(t)), t = 1 / (1 + z/2), with P the Chebyshev fit
// of Numerical Recipes (section 6.2: relative error below 1.2e-7 for every z). Each tail is
// erfc of its own |x|, never 1 - (1 - a tiny number), so Phi keeps its relative accuracy far
// into the negative tail, where 0.5 (1 + erf) cancels. z stops at 9 (|x| 12.7), where Phi is
// 1e-37 (or 1 to float precision): further out it would come out denormal, a slow path.
inline float normal_cdf(float x) {
    float z = std::fabs(x) * 0.7071067811865476f;
    z = z > 9.0f ? 9.0f : z;
    const float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const float half_erfc = 0.5f * t * fast_exp(p - z * z);
    return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}

// Its density, phi(x) = exp(-x^2 / 2) / sqrt(2 pi), as exp(-x^2 / 2 - ln sqrt(2 pi)): so it
// bottoms out where fast_exp clamps, at 1.6e-38, still a normal float.
inline float normal_pdf(float x) { return fast_exp(-0.5f * x * x - 0.9189385332046727f); }

// Maximum of a row, in 16 independent lanes so it vectorizes (a plain running max does not:
// NaN semantics forbid reordering it).
inline float row_max(const float* x, int n) {
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = -INFINITY;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    float m = -INFINITY;
    for (int j = 0; j < 16; j++) m = lane[j] > m ? lane[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

// The shift that keeps a softmax's or log-sum-exp's exponentials from overflowing: the row's
// maximum. Its own function so that its derivative is zero (below): softmax(x - c) and
// logsumexp(x - c) + c do not depend on c, so the gradient through the shift cancels
// exactly (JAX's logsumexp stops the gradient of its max for the same reason).
inline float softmax_shift(const float* x, int n) { return row_max(x, n); }
// The same over a row's keys first..keys-1 without the hidden span [lo, hi) (attention.hpp).
inline float softmax_shift_skipping(const float* x, int first, int lo, int hi, int keys) {
    const float a = row_max(x + first, lo - first), b = row_max(x + hi, keys - hi);
    return a > b ? a : b;
}

// The exponential as a primitive whose derivative is its own value: the Clad derivatives of
// these two (below) read the output back, where fast_exp's can only recompute it from its
// argument. A pullback through them exponentiates once, not twice.
// y = exp(x - shift) over a row (attention.hpp).
inline void exp_row(const float* x, float shift, float* y, int n) {
    for (int j = 0; j < n; j++) y[j] = fast_exp(x[j] - shift);
}
// e^z written to *out, one element: for a row that becomes its own exponentials in place
// (cross_entropy.hpp), which exp_row's derivative, reading x for fast_exp's clamps, cannot take.
inline void exp_into(float z, float* out) { *out = fast_exp(z); }

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Derivatives Clad takes instead of differentiating the bodies above: fast_exp bit-casts
// through memcpy, which Clad cannot see through; softmax_shift's is zero (row_max's lanes would
// be taped element by element, and no differentiated kernel calls row_max itself); exp_row's
// and exp_into's read their output (see each). All have a closed form.
namespace clad::custom_derivatives::zoo {
inline clad::ValueAndPushforward<float, float> fast_exp_pushforward(float x, float d_x) {
    float e = ::zoo::fast_exp(x);
    return {e, x < -87.0f || x > 87.0f ? 0.0f : e * d_x};  // flat where fast_exp clamps
}
// dPhi/dx = phi: the density itself, not the derivative of the fit (nor of its branches).
inline clad::ValueAndPushforward<float, float> normal_cdf_pushforward(float x, float d_x) {
    return {::zoo::normal_cdf(x), ::zoo::normal_pdf(x) * d_x};
}
inline clad::ValueAndPushforward<float, float> sigmoid_pushforward(float z, float d_z) {
    float s = ::zoo::sigmoid(z);
    return {s, s * (1.0f - s) * d_z};
}
// Shift invariance: nothing flows back through the shift, and the reverse sweep neither
// recomputes the maximum nor scans for where it is.
inline void softmax_shift_pullback(const float*, int, float, float*, int*) {}
inline void softmax_shift_skipping_pullback(const float*, int, int, int, int, float, float*, int*, int*, int*, int*) {}
// d(e^u) = e^u du, with e^u the output y (flat where fast_exp clamps, as fast_exp_pushforward).
// y's adjoint is consumed (zeroed): y was written.
inline void exp_row_pullback(const float* x, float shift, float* y, int n, float* d_x, float* d_shift, float* d_y,
                             int*) {
    float ds = 0.0f;
    for (int j = 0; j < n; j++) {
        const float u = x[j] - shift, g = u < -87.0f || u > 87.0f ? 0.0f : d_y[j] * y[j];
        d_x[j] += g;
        ds -= g;
        d_y[j] = 0.0f;
    }
    *d_shift += ds;
}
// d e^z / dz = e^z, which *out holds when the reverse sweep reaches the call (a caller must not
// overwrite it after the call; Clad passes the same pointer back and does not restore it);
// the call overwrote *out, so its adjoint is consumed.
inline void exp_into_pullback(float, float* out, float* d_z, float* d_out) {
    *d_z += *out * *d_out;
    *d_out = 0.0f;
}
}  // namespace clad::custom_derivatives::zoo
#endif
