// SwiGLU: input rows are [gate (F) | up (F)] from one fused GEMM; y = silu(gate) * up.
#pragma once
#include <cmath>
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// The element as a scalar function: the Clad backend's pullback is Clad's gradient of it
// (reverse mode, both partials from one call; clad_backend.hpp).
inline float swiglu(float gate, float up) { return gate * sigmoid(gate) * up; }

inline void swiglu_forward_row(const float* gate_up, float* y, int F) {
    for (int i = 0; i < F; i++) y[i] = swiglu(gate_up[i], gate_up[F + i]);
}

struct SwiGLU {
    int F;

    // gate_up: (N, 2F); y: (N, F).
    void forward(const float* gate_up, float* y, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            swiglu_forward_row(gate_up + (size_t)n * 2 * F, y + (size_t)n * F, F);
    }

    // Writes d_gate_up.
    void pullback(const float* gate_up, const float* dy, float* d_gate_up, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* gu = gate_up + (size_t)n * 2 * F;
            const float* dyr = dy + (size_t)n * F;
            float* d = d_gate_up + (size_t)n * 2 * F;
            for (int i = 0; i < F; i++) {
                float g = gu[i], u = gu[F + i];
                float s = 1.0f / (1.0f + fast_exp(-g));
                d[i] = dyr[i] * u * s * (1.0f + g * (1.0f - s));
                d[F + i] = dyr[i] * g * s;
            }
        }
    }

    // The training pullback: the recompute of y (the down projection's weight gradient reads
    // it; it is not kept from the forward) and d_gate_up from the same exponential, in one
    // pass over gate_up and dy. y is the forward's formula (swiglu; equal to rounding).
    void recompute_and_pullback(const float* gate_up, const float* dy, float* y, float* d_gate_up,
                                int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* gu = gate_up + (size_t)n * 2 * F;
            const float* dyr = dy + (size_t)n * F;
            float* yr = y + (size_t)n * F;
            float* d = d_gate_up + (size_t)n * 2 * F;
            for (int i = 0; i < F; i++) {
                const float g = gu[i], u = gu[F + i], s = sigmoid(g);
                yr[i] = g * s * u;
                d[i] = dyr[i] * u * s * (1.0f + g * (1.0f - s));
                d[F + i] = dyr[i] * g * s;
            }
        }
    }
};

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock swiglu_block{
    "swiglu", /*gate_width=*/2,
    [](int F, const float* x, float* y, int N) { SwiGLU{F}.forward(x, y, N); },
    [](int F, const float* x, const float* dy, float* dx, int N) { SwiGLU{F}.pullback(x, dy, dx, N); },
    [](int F, const float* x, const float* dy, float* y, float* dx, int N) {
        SwiGLU{F}.recompute_and_pullback(x, dy, y, dx, N);
    },
    ZOO_CLAD_FN(&gated_pullback_clad<swiglu>),
    ZOO_CLAD_FN(&gated_recompute_and_pullback_clad<swiglu>),
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template void zoo::gated_pullback_clad<zoo::swiglu>(int, const float*, const float*, float*, int);
template void zoo::gated_recompute_and_pullback_clad<zoo::swiglu>(int, const float*, const float*, float*, float*, int);
#endif
