// The Clad backend: the one translation unit compiled with the Clad plugin (a Clad build
// only; see CMakeLists.txt). With ZOO_CLAD_TU defined, every block header adds the
// definitions of its pullback_clad, each a clad::gradient of the block's own forward row
// kernel; Clad writes the derivative code here, at compile time. Nothing of Clad is linked or
// loaded at run time.
#define ZOO_CLAD_TU 1
#include "clad/Differentiator/Differentiator.h"

// clad_backend.hpp and fastmath.hpp (custom derivatives) come in through the blocks.
#include "blocks/attention.hpp"
#include "blocks/cross_entropy.hpp"
#include "blocks/embedding.hpp"
#include "blocks/gelu.hpp"
#include "blocks/layernorm.hpp"
#include "blocks/linear.hpp"
#include "blocks/relu2.hpp"
#include "blocks/residual.hpp"
#include "blocks/rmsnorm.hpp"
#include "blocks/rope.hpp"
#include "blocks/swiglu.hpp"

namespace zoo {
// Activations go through one template; each one the executor uses is instantiated here.
// A block written as a forward only needs this line and nothing else of the backend.
template void activation_pullback_clad<gelu_forward_row>(int, const float*, const float*, float*, float*, int);
template void activation_pullback_clad<relu2_forward_row>(int, const float*, const float*, float*, float*, int);
}  // namespace zoo
