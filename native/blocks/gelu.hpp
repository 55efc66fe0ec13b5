// GELU, tanh approximation (GPT-2's gelu_new, PyTorch's gelu(approximate="tanh"), Hugging Face's
// gelu_pytorch_tanh): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). Computed as
// x * sigmoid(2u), the same function, which needs one exp and no cancellation. GeGLU gates with
// it (geglu.hpp).
#pragma once
#include "blocks/activation.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// The element function: the forward, and what Clad differentiates (activation.hpp).
inline float gelu(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return x * sigmoid(2.0f * (k * (x + 0.044715f * x * x * x)));
}

// Its derivative, given its value y = x s: with s = sigmoid(2u), d/dx [x s] = s + 2 y (1 - s)
// du/dx. The same sigmoid as gelu's, so a pass that computes both exponentiates once.
inline float gelu_derivative(float x, float y) {
    const float k = 0.7978845608028654f;
    const float s = sigmoid(2.0f * (k * (x + 0.044715f * x * x * x)));
    return s + 2.0f * y * (1.0f - s) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock gelu_block = elementwise_activation<gelu, gelu_derivative>("gelu");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::ElementwiseClad<zoo::gelu>;  // its Clad pullbacks (activation.hpp)
#endif
