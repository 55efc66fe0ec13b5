// GeGLU (Gemma's MLP): input rows are [gate (F) | up (F)] from one fused GEMM;
// y = gelu(gate) * up, with GELU in its tanh approximation (gelu.hpp; Hugging Face's
// hidden_act "gelu_pytorch_tanh").
#pragma once
#include "blocks/activation.hpp"
#include "blocks/gelu.hpp"

namespace zoo {

// The element function: the forward, and what Clad differentiates (activation.hpp).
inline float geglu(float gate, float up) { return gelu(gate) * up; }

// Its partial derivatives; gelu and its derivative share their sigmoid.
inline GatedPartials geglu_partials(float gate, float up) {
    const float g = gelu(gate);
    return {gelu_derivative(gate, g) * up, g};
}

// The registry entry (native/blocks/registry.hpp).
inline const ActivationBlock geglu_block = gated_activation<geglu, geglu_partials>("geglu");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::GatedClad<zoo::geglu>;  // its Clad pullbacks (activation.hpp)
#endif
