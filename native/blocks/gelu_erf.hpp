// GELU in its exact form (PyTorch's gelu(), Hugging Face's hidden_act "gelu": GPT-NeoX and
// Pythia): 0.5 x (1 + erf(x / sqrt 2)). gelu.hpp is the tanh approximation GPT-2 uses.
#pragma once
#include "blocks/activation.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// The element function: the forward, and what Clad differentiates (activation.hpp). 0.5 (1 +
// erf(x / sqrt 2)) is the normal distribution function, here in fastmath.hpp's vectorizing form.
inline float gelu_erf(float x) { return x * normal_cdf(x); }

// Its derivative: Phi(x) + x phi(x). Phi as gelu_erf's, so a pass that computes both
// evaluates it once.
inline float gelu_erf_derivative(float x, float /*y*/) { return normal_cdf(x) + x * normal_pdf(x); }

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock gelu_erf_block = elementwise_activation<gelu_erf, gelu_erf_derivative>("gelu_erf");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::ElementwiseClad<zoo::gelu_erf>;  // its Clad pullbacks (activation.hpp; normal_cdf's derivative in fastmath.hpp)
#endif
