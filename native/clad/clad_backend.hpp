// The Clad backend's shared pieces. The pullbacks themselves sit in the block headers next to
// the hand-written ones, each under #ifdef ZOO_CLAD_TU: only native/clad/clad_pullbacks.cpp, which
// a Clad build compiles with the plugin, defines them (the activations' all at once, in
// blocks/activation.hpp). Their declarations are visible to every translation unit.
#pragma once
#include <omp.h>

#include <cstddef>

#include "kernels/columns.hpp"

namespace zoo {

// Per-thread scratch rows are padded to 16 floats (64 bytes) so threads never share a line.
inline size_t clad_pad(size_t n) { return (n + 15) / 16 * 16; }

}  // namespace zoo
