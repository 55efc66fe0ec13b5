// GELU, tanh approximation (GPT-2's gelu_new): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Computed as x * sigmoid(2u), the same function, which needs one exp and no cancellation.
#pragma once
#include <cmath>

#include "../fastmath.hpp"

namespace zoo {

inline void gelu_forward_row(const float* x, float* y, int C) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    for (int i = 0; i < C; i++) {
        float u = k * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
        y[i] = x[i] / (1.0f + fast_exp(-2.0f * u));
    }
}

struct GELU {
    int C;

    void forward(const float* x, float* y, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) gelu_forward_row(x + (size_t)n * C, y + (size_t)n * C, C);
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
};

}  // namespace zoo
