// SwiGLU: input rows are [gate (F) | up (F)] from one fused GEMM; y = silu(gate) * up.
#pragma once
#include <cmath>

#include "../fastmath.hpp"

namespace zoo {

inline void swiglu_forward_row(const float* gate_up, float* y, int F) {
    for (int i = 0; i < F; i++) {
        float g = gate_up[i];
        y[i] = g / (1.0f + fast_exp(-g)) * gate_up[F + i];
    }
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
};

}  // namespace zoo
