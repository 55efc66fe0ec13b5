// Squared ReLU, y = max(x, 0)^2 (So et al., "Primer", 2021): a non-gated MLP activation,
// ModelConfig(mlp="relu2"). The worked example of a block written as its forward only
// (docs/adding_a_block.md): there is no hand-written pullback. A Clad build generates one from
// the element function relu2 (elementwise_pullback_clad in clad_backend.hpp); a build without
// Clad runs this block forward only, and training a model that uses it stops with a message.
#pragma once
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"

namespace zoo {

// The element as a scalar function: Clad differentiates it in forward mode with no tape.
// (Differentiated as the row loop, the ternary's condition is taped per element: 15x slower.)
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

// The registry entry (native/blocks/registry.hpp): no hand-written pullback; Clad's where it is built.
inline const ActivationBlock relu2_block{
    "relu2", /*gate_width=*/1,
    [](int F, const float* x, float* y, int N) { ReLU2{F}.forward(x, y, N); },
    nullptr,
    nullptr,
    ZOO_CLAD_FN(&elementwise_pullback_clad<relu2>),
    ZOO_CLAD_FN(&elementwise_recompute_and_pullback_clad<relu2>),
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template void zoo::elementwise_pullback_clad<zoo::relu2>(int, const float*, const float*, float*, int);
template void zoo::elementwise_recompute_and_pullback_clad<zoo::relu2>(int, const float*, const float*, float*, float*,
                                                                       int);
#endif
