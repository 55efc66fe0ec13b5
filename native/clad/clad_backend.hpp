// The Clad backend's shared pieces. The pullbacks themselves sit in the block headers next to
// the hand-written ones, each under #ifdef ZOO_CLAD_TU: only native/clad/clad_pullbacks.cpp, which
// a Clad build compiles with the plugin, defines them. Declarations here are visible to every
// translation unit; definitions only to that one.
#pragma once
#include <omp.h>

#include <cstddef>

#include "kernels/columns.hpp"

namespace zoo {

// Per-thread scratch rows are padded to 16 floats (64 bytes) so threads never share a line.
inline size_t clad_pad(size_t n) { return (n + 15) / 16 * 16; }

// The pullbacks of an elementwise activation, y = f(x) element by element, or a gated one,
// y = f(gate, up) over rows [gate (F) | up (F)]: the derivative is diagonal, so Clad
// differentiates the element function itself: forward mode for f(x) (value and derivative in
// one pass, no tape), reverse mode for f(gate, up) (both partials from one call). The loops are
// the same as the forward's. Each writes dx; the recompute_and_pullback ones write y = f(x) too,
// the executor's fused MLP step, where value and derivative share the exponential (docs/clad.md).
// A block written as its element function needs nothing more (relu2.hpp, docs/adding_a_block.md).
using ElementFn = float (*)(float x);
using GatedElementFn = float (*)(float gate, float up);
template <ElementFn f>
void elementwise_pullback_clad(int C, const float* x, const float* dy, float* dx, int N);
template <ElementFn f>
void elementwise_recompute_and_pullback_clad(int C, const float* x, const float* dy, float* y, float* dx, int N);
template <GatedElementFn f>
void gated_pullback_clad(int F, const float* gate_up, const float* dy, float* d_gate_up, int N);
template <GatedElementFn f>
void gated_recompute_and_pullback_clad(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up,
                                       int N);

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace zoo {

// Elements in one contiguous chunk per thread, as the forwards run them. y null: dx only. Each
// input is read into a local once: read again after the store to y (which may alias x, as far
// as the compiler knows), the value and the derivative would not share their exponential.
template <ElementFn f>
void elementwise_pass_clad(const float* x, const float* dy, float* y, float* dx, long total) {
#pragma omp parallel
    {
        auto derivative = clad::differentiate(f, "x");
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long begin = total * t / nt, end = total * (t + 1) / nt;
        if (y)
            for (long i = begin; i < end; i++) {
                const float xi = x[i];
                y[i] = f(xi);
                dx[i] = dy[i] * derivative.execute(xi);
            }
        else
            for (long i = begin; i < end; i++) dx[i] = dy[i] * derivative.execute(x[i]);
    }
}

template <ElementFn f>
void elementwise_pullback_clad(int C, const float* x, const float* dy, float* dx, int N) {
    elementwise_pass_clad<f>(x, dy, nullptr, dx, (long)N * C);
}

template <ElementFn f>
void elementwise_recompute_and_pullback_clad(int C, const float* x, const float* dy, float* y, float* dx, int N) {
    elementwise_pass_clad<f>(x, dy, y, dx, (long)N * C);
}

// One row of a gated pullback, y null: d_gate_up only. A function of its own with restrict
// pointers: inlined in the parallel loop, clang (19) versions the loop on alias checks that
// fail at run time, and the scalar version runs (5x slower).
template <GatedElementFn f>
void gated_row_clad(const float* __restrict__ gate, const float* __restrict__ up, const float* __restrict__ dy,
                    float* __restrict__ y, float* __restrict__ d_gate, float* __restrict__ d_up, int F) {
    auto gradient = clad::gradient(f);
    if (y)
        for (int i = 0; i < F; i++) {
            const float g = gate[i], u = up[i];
            float dg = 0.0f, du = 0.0f;  // the gradient adds into them
            gradient.execute(g, u, &dg, &du);
            y[i] = f(g, u);
            d_gate[i] = dy[i] * dg;
            d_up[i] = dy[i] * du;
        }
    else
        for (int i = 0; i < F; i++) {
            float dg = 0.0f, du = 0.0f;
            gradient.execute(gate[i], up[i], &dg, &du);
            d_gate[i] = dy[i] * dg;
            d_up[i] = dy[i] * du;
        }
}

// Rows in parallel, as the gated forwards run them.
template <GatedElementFn f>
void gated_pass_clad(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up, int N) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* gate = gate_up + (size_t)n * 2 * F;
        float* d_gate = d_gate_up + (size_t)n * 2 * F;
        gated_row_clad<f>(gate, gate + F, dy + (size_t)n * F, y ? y + (size_t)n * F : nullptr, d_gate, d_gate + F, F);
    }
}

template <GatedElementFn f>
void gated_pullback_clad(int F, const float* gate_up, const float* dy, float* d_gate_up, int N) {
    gated_pass_clad<f>(F, gate_up, dy, nullptr, d_gate_up, N);
}

template <GatedElementFn f>
void gated_recompute_and_pullback_clad(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up,
                                       int N) {
    gated_pass_clad<f>(F, gate_up, dy, y, d_gate_up, N);
}

}  // namespace zoo
#endif
