// The Clad backend: the one translation unit compiled with the Clad plugin (a Clad build
// only; see CMakeLists.txt). With ZOO_CLAD_TU defined, every block header adds the
// definitions of its pullback_clad, each a clad::gradient of the block's own forward row
// kernel; Clad writes the derivative code here, at compile time. Nothing of Clad is linked or
// loaded at run time.
#define ZOO_CLAD_TU 1
#include "clad/Differentiator/Differentiator.h"

// Every block comes in through the registry; clad_backend.hpp and fastmath.hpp (custom
// derivatives) through the blocks. Each header defines its Clad pullbacks, and instantiates
// the generic activation pullback for its row kernel, under ZOO_CLAD_TU.
#include "blocks/registry.hpp"
// Layer arrangements: Clad chains their block calls (layers.hpp).
#include "layers/layers.hpp"
