// SwiGLU (Llama's MLP): input rows are [gate (F) | up (F)] from one fused GEMM; y = silu(gate) * up.
#pragma once
#include "blocks/activation.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// The element function: the forward, and what Clad differentiates (activation.hpp).
inline float swiglu(float gate, float up) { return gate * sigmoid(gate) * up; }

// Its partial derivatives: with s = sigmoid(gate), d silu/dgate = s (1 + gate (1 - s)).
inline GatedPartials swiglu_partials(float gate, float up) {
    const float s = sigmoid(gate);
    return {up * s * (1.0f + gate * (1.0f - s)), gate * s};
}

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock swiglu_block = gated_activation<swiglu, swiglu_partials>("swiglu");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::GatedClad<zoo::swiglu>;  // its Clad pullbacks (activation.hpp)
#endif
