// What every MLP activation shares: the loops. An activation is written as its element
// function and that function's derivative (gelu.hpp, swiglu.hpp, geglu.hpp), and its registry
// entry comes from one of the two builders below:
//   elementwise_activation<f, df>: y = f(x) element by element (gate_width 1);
//   gated_activation<f, partials>: y = f(gate, up) over rows [gate (F) | up (F)] from one
//     fused GEMM (gate_width 2), partials giving both partial derivatives.
// The derivative is diagonal, so a pullback is one pass: dx = dy * f'(x), and in the executor's
// fused MLP step y = f(x) beside it (the down projection's weight gradient reads y, which is
// not kept from the forward); inlined, the value and the derivative share their exponential.
// The hand-written pullbacks run that pass with the block's own derivative, the Clad backend's
// with Clad's derivative of the element function (defined below, in the Clad build only): one
// loop for both. A block may leave its derivative out (relu2.hpp): it then trains on Clad's alone.
#pragma once
#include <omp.h>

#include <cstddef>

#include "blocks/block.hpp"

namespace zoo {

using ElementFn = float (*)(float x);
// f'(x), given the value y = f(x), which the pass computes anyway (the recompute stores it).
// GELU's derivative is written from it: so written, both of its pullbacks round bit for bit as
// its two hand-fused loops did before this header (g++ reassociates under -fassociative-math,
// and the value's product x s is the grouping those loops got), and GPT-2 trains to the same
// losses (docs/benchmarks.md, issue 27).
using ElementDerivativeFn = float (*)(float x, float y);
using GatedElementFn = float (*)(float gate, float up);
struct GatedPartials {
    float gate, up;  // df/dgate, df/dup
};
using GatedPartialsFn = GatedPartials (*)(float gate, float up);

// --- elementwise ---------------------------------------------------------------------------

// One contiguous chunk per thread: g++ vectorizes the loop called this way about 10x better
// than a row loop inside the parallel loop.
template <ElementFn f>
void elementwise_forward_chunk(const float* x, float* y, long n) {
    for (long i = 0; i < n; i++) y[i] = f(x[i]);
}

template <ElementFn f>
void elementwise_forward(int C, const float* x, float* y, int N) {
    const long total = (long)N * C;
#pragma omp parallel
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long begin = total * t / nt, end = total * (t + 1) / nt;
        elementwise_forward_chunk<f>(x + begin, y + begin, end - begin);
    }
}

// One thread's chunk of the pullback: dx = dy * f'(x), and y = f(x) where y is not null. Restrict
// pointers in a function of its own (the buffers never overlap): otherwise clang (19) versions
// the loop on alias checks that fail at run time and runs the scalar version, and a store to y
// would make x[i] be read again for df, which then no longer shares f's exponential.
template <ElementFn f, ElementDerivativeFn df>
void elementwise_pullback_chunk(const float* __restrict__ x, const float* __restrict__ dy, float* __restrict__ y,
                                float* __restrict__ dx, long n) {
    if (y)
        for (long i = 0; i < n; i++) {
            const float value = f(x[i]);
            y[i] = value;
            dx[i] = dy[i] * df(x[i], value);
        }
    else  // (a derivative that does not read the value leaves f's computation dead: it is dropped)
        for (long i = 0; i < n; i++) dx[i] = dy[i] * df(x[i], f(x[i]));
}

template <ElementFn f, ElementDerivativeFn df>
void elementwise_pass(const float* x, const float* dy, float* y, float* dx, long total) {
#pragma omp parallel
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long begin = total * t / nt, end = total * (t + 1) / nt;
        elementwise_pullback_chunk<f, df>(x + begin, dy + begin, y ? y + begin : nullptr, dx + begin, end - begin);
    }
}

// The registry's two pullback signatures (block.hpp): dx; y and dx.
template <ElementFn f, ElementDerivativeFn df>
void elementwise_pullback(int C, const float* x, const float* dy, float* dx, int N) {
    elementwise_pass<f, df>(x, dy, nullptr, dx, (long)N * C);
}
template <ElementFn f, ElementDerivativeFn df>
void elementwise_recompute_and_pullback(int C, const float* x, const float* dy, float* y, float* dx, int N) {
    elementwise_pass<f, df>(x, dy, y, dx, (long)N * C);
}

// The Clad backend's pullbacks: the same pass with Clad's derivative of f. Declared for every
// translation unit (the registry entry takes their addresses), defined only in the Clad one
// (below), where each activation's header instantiates this struct for its element function.
template <ElementFn f>
struct ElementwiseClad {
    static void pullback(int C, const float* x, const float* dy, float* dx, int N);
    static void recompute_and_pullback(int C, const float* x, const float* dy, float* y, float* dx, int N);
};

// The registry entry; df null: no hand-written pullback.
template <ElementFn f, ElementDerivativeFn df = nullptr>
constexpr ActivationBlock elementwise_activation(const char* name) {
    ActivationBlock entry{name, /*gate_width=*/1, elementwise_forward<f>, nullptr, nullptr,
                          ZOO_CLAD_FN(&ElementwiseClad<f>::pullback),
                          ZOO_CLAD_FN(&ElementwiseClad<f>::recompute_and_pullback)};
    if constexpr (df != nullptr) {
        entry.pullback = elementwise_pullback<f, df>;
        entry.recompute_and_pullback = elementwise_recompute_and_pullback<f, df>;
    }
    return entry;
}

// --- gated: rows [gate (F) | up (F)] in, rows of F out ----------------------------------------

template <GatedElementFn f>
void gated_forward_row(const float* gate, const float* up, float* y, int F) {
    for (int i = 0; i < F; i++) y[i] = f(gate[i], up[i]);
}

template <GatedElementFn f>
void gated_forward(int F, const float* gate_up, float* y, int N) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* gate = gate_up + (size_t)n * 2 * F;
        gated_forward_row<f>(gate, gate + F, y + (size_t)n * F, F);
    }
}

// One row of the pullback: d_gate, d_up, and y where not null. Restrict pointers in a
// function of its own, as for the elementwise chunk.
template <GatedElementFn f, GatedPartialsFn partials>
void gated_pullback_row(const float* __restrict__ gate, const float* __restrict__ up, const float* __restrict__ dy,
                        float* __restrict__ y, float* __restrict__ d_gate, float* __restrict__ d_up, int F) {
    if (y)
        for (int i = 0; i < F; i++) {
            const GatedPartials d = partials(gate[i], up[i]);
            y[i] = f(gate[i], up[i]);
            d_gate[i] = dy[i] * d.gate;
            d_up[i] = dy[i] * d.up;
        }
    else
        for (int i = 0; i < F; i++) {
            const GatedPartials d = partials(gate[i], up[i]);
            d_gate[i] = dy[i] * d.gate;
            d_up[i] = dy[i] * d.up;
        }
}

// Rows in parallel, as the forward runs them.
template <GatedElementFn f, GatedPartialsFn partials>
void gated_pass(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up, int N) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* gate = gate_up + (size_t)n * 2 * F;
        float* d_gate = d_gate_up + (size_t)n * 2 * F;
        gated_pullback_row<f, partials>(gate, gate + F, dy + (size_t)n * F, y ? y + (size_t)n * F : nullptr, d_gate,
                                        d_gate + F, F);
    }
}

template <GatedElementFn f, GatedPartialsFn partials>
void gated_pullback(int F, const float* gate_up, const float* dy, float* d_gate_up, int N) {
    gated_pass<f, partials>(F, gate_up, dy, nullptr, d_gate_up, N);
}
template <GatedElementFn f, GatedPartialsFn partials>
void gated_recompute_and_pullback(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up, int N) {
    gated_pass<f, partials>(F, gate_up, dy, y, d_gate_up, N);
}

// The Clad backend's pullbacks, as ElementwiseClad.
template <GatedElementFn f>
struct GatedClad {
    static void pullback(int F, const float* gate_up, const float* dy, float* d_gate_up, int N);
    static void recompute_and_pullback(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up, int N);
};

// The registry entry; partials null: no hand-written pullback.
template <GatedElementFn f, GatedPartialsFn partials = nullptr>
constexpr ActivationBlock gated_activation(const char* name) {
    ActivationBlock entry{name, /*gate_width=*/2, gated_forward<f>, nullptr, nullptr,
                          ZOO_CLAD_FN(&GatedClad<f>::pullback), ZOO_CLAD_FN(&GatedClad<f>::recompute_and_pullback)};
    if constexpr (partials != nullptr) {
        entry.pullback = gated_pullback<f, partials>;
        entry.recompute_and_pullback = gated_recompute_and_pullback<f, partials>;
    }
    return entry;
}

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace zoo {

// Clad's derivative of an element function: forward mode for f(x) (value and derivative in one
// pass, nothing stored), reverse mode for f(gate, up) (both partials from one call). Inlined
// into the pass, the value Clad computes along is dropped and f(x)'s, computed beside it,
// shares the exponential, as with a hand-written derivative (docs/clad.md).
template <ElementFn f>
float clad_derivative(float x, float /*value*/) {
    return clad::differentiate(f, "x").execute(x);
}
template <GatedElementFn f>
GatedPartials clad_partials(float gate, float up) {
    GatedPartials d{0.0f, 0.0f};  // the gradient adds into them
    clad::gradient(f).execute(gate, up, &d.gate, &d.up);
    return d;
}

template <ElementFn f>
void ElementwiseClad<f>::pullback(int C, const float* x, const float* dy, float* dx, int N) {
    elementwise_pass<f, clad_derivative<f>>(x, dy, nullptr, dx, (long)N * C);
}
template <ElementFn f>
void ElementwiseClad<f>::recompute_and_pullback(int C, const float* x, const float* dy, float* y, float* dx, int N) {
    elementwise_pass<f, clad_derivative<f>>(x, dy, y, dx, (long)N * C);
}

template <GatedElementFn f>
void GatedClad<f>::pullback(int F, const float* gate_up, const float* dy, float* d_gate_up, int N) {
    gated_pass<f, clad_partials<f>>(F, gate_up, dy, nullptr, d_gate_up, N);
}
template <GatedElementFn f>
void GatedClad<f>::recompute_and_pullback(int F, const float* gate_up, const float* dy, float* y, float* d_gate_up,
                                          int N) {
    gated_pass<f, clad_partials<f>>(F, gate_up, dy, y, d_gate_up, N);
}

}  // namespace zoo
#endif
