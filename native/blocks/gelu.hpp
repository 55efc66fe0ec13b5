// GELU, tanh approximation (GPT-2's gelu_new): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Computed as x * sigmoid(2u), the same function, which needs one exp and no cancellation.
#pragma once
#include <cmath>
#include <cstddef>

#include <omp.h>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// The element as a scalar function: the Clad backend's pullback is Clad's derivative of it
// (forward mode, value and derivative together; clad_backend.hpp).
inline float gelu(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return x * sigmoid(2.0f * (k * (x + 0.044715f * x * x * x)));
}

inline void gelu_forward_row(const float* x, float* y, int C) {
    for (int i = 0; i < C; i++) y[i] = gelu(x[i]);
}

struct GELU {
    int C;

    // Elementwise, so each thread takes one contiguous chunk: g++ vectorizes the row kernel
    // called this way about 10x better than called row by row inside the parallel loop.
    void forward(const float* x, float* y, int N) const {
        const long total = (long)N * C;
#pragma omp parallel
        {
            const long t = omp_get_thread_num(), nt = omp_get_num_threads();
            const long begin = total * t / nt, end = total * (t + 1) / nt;
            gelu_forward_row(x + begin, y + begin, (int)(end - begin));
        }
    }

    // Writes dx (the activation is the only consumer of its input).
    void pullback(const float* x, const float* dy, float* dx, int N) const {
        const float k = 0.7978845608028654f;
        const long total = (long)N * C;
#pragma omp parallel for schedule(static)
        for (long i = 0; i < total; i++) {
            float xi = x[i];
            float s = 1.0f / (1.0f + fast_exp(-2.0f * k * (xi + 0.044715f * xi * xi * xi)));
            float du = k * (1.0f + 3.0f * 0.044715f * xi * xi);
            dx[i] = dy[i] * (s + 2.0f * xi * s * (1.0f - s) * du);
        }
    }

    // The training pullback: the recompute of y (the output projection's weight gradient
    // reads it; it is not kept from the forward) and dx = dy * dy/dx from the same
    // exponential, in one pass over x and dy. y is the forward's formula (equal to rounding).
    void recompute_and_pullback(const float* x, const float* dy, float* y, float* dx, int N) const {
        const float k = 0.7978845608028654f;
        const long total = (long)N * C;
#pragma omp parallel for schedule(static)
        for (long i = 0; i < total; i++) {
            const float xi = x[i];
            const float s = sigmoid(2.0f * (k * (xi + 0.044715f * xi * xi * xi)));
            y[i] = xi * s;
            dx[i] = dy[i] * (s + 2.0f * xi * s * (1.0f - s) * k * (1.0f + 3.0f * 0.044715f * xi * xi));
        }
    }
};

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock gelu_block{
    "gelu", /*gate_width=*/1,
    [](int F, const float* x, float* y, int N) { GELU{F}.forward(x, y, N); },
    [](int F, const float* x, const float* dy, float* dx, int N) { GELU{F}.pullback(x, dy, dx, N); },
    [](int F, const float* x, const float* dy, float* y, float* dx, int N) {
        GELU{F}.recompute_and_pullback(x, dy, y, dx, N);
    },
    ZOO_CLAD_FN(&elementwise_pullback_clad<gelu>),
    ZOO_CLAD_FN(&elementwise_recompute_and_pullback_clad<gelu>),
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template void zoo::elementwise_pullback_clad<zoo::gelu>(int, const float*, const float*, float*, int);
template void zoo::elementwise_recompute_and_pullback_clad<zoo::gelu>(int, const float*, const float*, float*, float*,
                                                                      int);
#endif
