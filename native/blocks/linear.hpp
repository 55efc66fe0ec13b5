// Linear layer: y = x W^T + b, W stored (out, in) like torch.nn.Linear; its products in the
// layer's precision (gemm.hpp: fp32, or bf16 operands with fp32 accumulation).
#pragma once
#include <cstddef>
#include <cstring>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/columns.hpp"
#include "kernels/gemm.hpp"

namespace zoo {

// y += x W^T, x (N, in), W (out, in), y (N, out): the layer's GEMM as a function of its own,
// so Clad can be handed its derivative (the hand-written one, below). precision is a
// Precision as an int: Clad passes integers through.
inline void linear_gemm(const float* x, const float* W, float* y, int N, int in, int out, int precision) {
    gemm::gemm((Precision)precision, false, true, N, out, in, x, in, W, in, 1.0f, y, out);
}

// y[n] += b, row n of y. The row index is an argument, not an offset of y: Clad (master
// 4b2c0eef) drops the reverse loop's n-- when n appears only in a pointer offset.
inline void linear_bias_row(const float* b, float* y, int n, int out) {
    for (int o = 0; o < out; o++) y[(size_t)n * out + o] += b[o];
}

// The layer as Clad differentiates it: y += b on every row, then y += x W^T. The same
// arithmetic as Linear::forward with residual = y, which runs the bias rows in parallel.
// Bias first: after the GEMM, Clad would tape y for the GEMM's derivative.
inline void linear_forward_rows(const float* x, const float* W, const float* b, float* y, int N,
                                int in, int out, int precision) {
    for (int n = 0; n < N; n++) linear_bias_row(b, y, n, out);
    linear_gemm(x, W, y, N, in, out, precision);
}

inline void linear_forward_rows_nobias(const float* x, const float* W, float* y, int N, int in,
                                       int out, int precision) {
    linear_gemm(x, W, y, N, in, out, precision);
}

struct Linear {
    int in, out;
    Precision precision = Precision::fp32;

    // x: (N, in); y: (N, out); b may be null. With residual (which may be y itself):
    // y = residual + x W^T + b, the residual add fused into the GEMM: one pass writes
    // residual + b into y, and the GEMM adds onto it (beta = 1).
    void forward(const float* x, const float* W, const float* b, float* y, int N,
                 const float* residual = nullptr) const {
        add_bias_and_residual(b, y, N, residual);
        gemm::gemm(precision, false, true, N, out, in, x, in, W, in, b || residual ? 1.0f : 0.0f, y, out);
    }

    // y = residual + b (either may be null; both null: nothing), for a GEMM to add onto.
    void add_bias_and_residual(const float* b, float* y, int N, const float* residual) const {
        if (!b && !residual) return;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float* yr = y + (size_t)n * out;
            const float* rr = residual ? residual + (size_t)n * out : nullptr;
            if (rr && b)
                for (int o = 0; o < out; o++) yr[o] = rr[o] + b[o];
            else if (b)
                std::memcpy(yr, b, sizeof(float) * out);
            else if (rr != yr)
                std::memcpy(yr, rr, sizeof(float) * out);
        }
    }

    // The same over a weight in a storage format (quant.hpp): a frozen base. scratch:
    // scratch_floats(W.dtype, N) floats, where the product widens W a tile at a time.
    size_t scratch_floats(DType t, int N) const { return gemm::matrix_scratch_floats(precision, t, N, out, in); }
    void forward(const float* x, const Matrix& W, const float* b, float* y, int N, const float* residual,
                 float* scratch) const {
        if (W.dtype == DType::f32) return forward(x, W.f32(), b, y, N, residual);
        add_bias_and_residual(b, y, N, residual);
        gemm::matrix_xwt(precision, N, x, in, W, b || residual ? 1.0f : 0.0f, y, out, scratch);
    }
    // The same with x already rounded to bf16 at the start of scratch (gemm::matrix_xwt_rounded;
    // a bf16 product with a narrow W).
    void forward_rounded(const Matrix& W, const float* b, float* y, int N, const float* residual, float* scratch) const {
        add_bias_and_residual(b, y, N, residual);
        gemm::matrix_xwt_rounded(N, W, b || residual ? 1.0f : 0.0f, y, out, scratch);
    }
    // dx = dy W (or += when accumulate_dx): a frozen weight's pullback has no dW.
    void pullback_input(const Matrix& W, const float* dy, float* dx, int N, bool accumulate_dx, float* scratch) const {
        gemm::matrix_xw(precision, N, dy, out, W, accumulate_dx ? 1.0f : 0.0f, dx, in, scratch);
    }

    // dx = dy W (added into dx when accumulate_dx, else written), dW = or += dy^T x,
    // db = or += column sums of dy, per mode: writing needs no zeroed gradients, and the GEMM
    // does not read the old dW. A null dx, dW or db is not computed (x is read only for dW).
    void pullback(const float* x, const float* W, const float* dy, float* dx, float* dW,
                  float* db, int N, bool accumulate_dx, GradMode mode) const {
        if (dx) pullback_input(W, dy, dx, N, accumulate_dx);
        if (dW) pullback_params(x, dy, dW, db, N, mode);
    }

    // The two halves of pullback, for a caller that needs dx before x is ready: the MLP's
    // pullback recomputes act, its output projection's input, in the same pass that turns
    // that projection's dx into the activation's adjoint.
    void pullback_input(const float* W, const float* dy, float* dx, int N, bool accumulate_dx = false) const {
        gemm::gemm(precision, false, false, N, in, out, dy, out, W, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
    }

    void pullback_params(const float* x, const float* dy, float* dW, float* db, int N, GradMode mode) const {
        const bool add = mode == GradMode::add;
        gemm::gemm(precision, true, false, out, in, N, dy, out, x, in, add ? 1.0f : 0.0f, dW, in);
        if (db) {
            const int block = column_block(out);
#pragma omp parallel for schedule(static)
            for (int o0 = 0; o0 < out; o0 += block) {
                int o1 = o0 + block < out ? o0 + block : out;
                if (!add)
                    for (int o = o0; o < o1; o++) db[o] = 0.0f;
                for (int n = 0; n < N; n++) {
                    const float* dyr = dy + (size_t)n * out;
                    for (int o = o0; o < o1; o++) db[o] += dyr[o];
                }
            }
        }
    }

    // The Clad backend's pullback: Clad's gradient of linear_forward_rows, which composes the
    // GEMM's hand-written derivative with the bias part Clad writes (defined below, compiled
    // only into a Clad build). Same contract as pullback, plus b (null: no bias) and
    // y_scratch, clad_scratch_floats(N) floats where the replayed forward adds the bias.
    size_t clad_scratch_floats(int N) const { return (size_t)N * out; }
    void pullback_clad(const float* x, const float* W, const float* b, const float* dy, float* dx,
                       float* dW, float* db, int N, bool accumulate_dx, GradMode mode,
                       float* y_scratch) const;
};

// The registry entry (native/blocks/registry.hpp): dx written; scratch as pullback_clad's y_scratch.
// Either half alone: dW and db null, dx only (x may be null); dx null, the parameters' only.
using LinearPullback = void (*)(const Linear& l, const float* x, const float* W, const float* b, const float* dy,
                                float* dx, float* dW, float* db, int N, GradMode mode, float* scratch);
void linear_pullback_clad(const Linear& l, const float* x, const float* W, const float* b, const float* dy,
                          float* dx, float* dW, float* db, int N, GradMode mode, float* scratch);
inline const FixedBlock<LinearPullback> linear_block{
    "linear",
    [](const Linear& l, const float* x, const float* W, const float*, const float* dy, float* dx, float* dW,
       float* db, int N, GradMode mode, float*) { l.pullback(x, W, dy, dx, dW, db, N, false, mode); },
    ZOO_CLAD_FN(linear_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace clad::custom_derivatives::zoo {
// Clad's pullback first replays the forward. A reverse_forw that carries a pullback_state
// replaces the GEMM in that replay; this one does nothing: the GEMM's output is already in
// the activation arena and no adjoint reads it, so the replay costs no GEMM.
inline void linear_gemm_reverse_forw(const float*, const float*, float*, int, int, int, int,
                                     const float*, const float*, float*, int, int, int, int,
                                     clad::pullback_state<>&) {}
// The GEMM's derivative: the hand-written pullback without its bias part.
inline void linear_gemm_pullback(const float* x, const float* W, float* y, int N, int in, int out,
                                 int precision, float* d_x, float* d_W, float* d_y, int*, int*, int*,
                                 int*, clad::pullback_state<>) {
    ::zoo::Linear{in, out, (::zoo::Precision)precision}.pullback(x, W, d_y, d_x, d_W, nullptr, N, /*accumulate_dx=*/true, ::zoo::GradMode::add);
}
}  // namespace clad::custom_derivatives::zoo

void zoo::Linear::pullback_clad(const float* x, const float* W, const float* b, const float* dy,
                                float* dx, float* dW, float* db, int N, bool accumulate_dx, GradMode mode,
                                float* y_scratch) const {
    // The gradient adds into every adjoint: clear the ones this pullback writes.
    if (dx && !accumulate_dx) std::memset(dx, 0, sizeof(float) * N * in);
    if (dW && mode == GradMode::write) {
        std::memset(dW, 0, sizeof(float) * out * in);
        if (db) std::memset(db, 0, sizeof(float) * out);
    }
    // y += ... passes its adjoint through unchanged, so the gradient reads dy and leaves it.
    float* d_y = const_cast<float*>(dy);
    // A null adjoint reaches the GEMM's derivative, which then skips that product; dx alone
    // differentiates the layer without its bias (dW and db are null together).
    if (b && db)
        clad::gradient(linear_forward_rows, "x, W, b, y")
            .execute(x, W, b, y_scratch, N, in, out, (int)precision, dx, dW, db, d_y);
    else
        clad::gradient(linear_forward_rows_nobias, "x, W, y")
            .execute(x, W, y_scratch, N, in, out, (int)precision, dx, dW, d_y);
}

void zoo::linear_pullback_clad(const Linear& l, const float* x, const float* W, const float* b, const float* dy,
                               float* dx, float* dW, float* db, int N, GradMode mode, float* scratch) {
    l.pullback_clad(x, W, b, dy, dx, dW, db, N, false, mode, scratch);
}
#endif
