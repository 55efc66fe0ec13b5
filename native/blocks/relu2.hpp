// Squared ReLU, y = max(x, 0)^2 (So et al., "Primer", 2021): a non-gated MLP activation,
// ModelConfig(mlp="relu2"). The worked example of a block written as its forward only
// (docs/adding_a_block.md): its element function and no derivative. A Clad build generates
// the pullback from the element function (activation.hpp); a build without Clad runs this block
// forward only, and training a model that uses it stops with a message.
#pragma once
#include "blocks/activation.hpp"

namespace zoo {

// The element function: Clad differentiates it in forward mode with no tape.
// (Differentiated as the row loop, the ternary's condition is taped per element: 15x slower.)
inline float relu2(float x) { return x > 0.0f ? x * x : 0.0f; }

// The registry entry (native/blocks/registry.hpp): no hand-written derivative, so no
// hand-written pullback; Clad's where it is built.
inline const ActivationBlock relu2_block = elementwise_activation<relu2>("relu2");

}  // namespace zoo

#ifdef ZOO_CLAD_TU
template struct zoo::ElementwiseClad<zoo::relu2>;  // its Clad pullbacks (activation.hpp)
#endif
