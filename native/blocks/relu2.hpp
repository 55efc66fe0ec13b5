// Squared ReLU, y = max(x, 0)^2 (So et al., "Primer", 2021): a non-gated MLP activation,
// ModelConfig(mlp="relu2"). The worked example of a block written as its forward only
// (docs/adding_a_block.md): there is no hand-written pullback. A Clad build generates one from
// relu2_forward_row (activation_pullback_clad in clad_backend.hpp); a build without Clad runs
// this block forward only, and training a model that uses it stops with a message.
#pragma once
#include <cstddef>

namespace zoo {

// The element as a scalar function: Clad differentiates it in forward mode with no tape.
// (The ternary written inline in the loop would tape its condition per element: 15x slower.)
inline float relu2(float x) { return x > 0.0f ? x * x : 0.0f; }

inline void relu2_forward_row(const float* x, float* y, int C) {
    for (int i = 0; i < C; i++) y[i] = relu2(x[i]);
}

struct ReLU2 {
    int C;

    void forward(const float* x, float* y, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) relu2_forward_row(x + (size_t)n * C, y + (size_t)n * C, C);
    }
};

}  // namespace zoo
