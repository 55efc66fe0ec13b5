// GELU in its exact form (PyTorch's gelu(), Hugging Face's hidden_act "gelu": GPT-NeoX and
// Pythia): 0.5 x (1 + erf(x / sqrt 2)). gelu.hpp is the tanh approximation GPT-2 uses.
#pragma once
#include <cmath>

#include "blocks/activation.hpp"

namespace zoo {

// The element function: the forward, and what Clad differentiates (activation.hpp).
inline float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f)); }

// Its derivative: Phi(x) + x phi(x), Phi and phi the normal distribution and density.
inline float gelu_erf_derivative(float x, float /*y*/) {
    return 0.5f * (1.0f + std::erf(x * 0.7071067811865476f)) + x * 0.3989422804014327f * std::exp(-0.5f * x * x);
}

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock gelu_erf_block = elementwise_activation<gelu_erf, gelu_erf_derivative>("gelu_erf");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::ElementwiseClad<zoo::gelu_erf>;  // its Clad pullbacks (activation.hpp; Clad knows erf's derivative)
#endif
