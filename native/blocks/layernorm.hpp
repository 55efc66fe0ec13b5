// LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * w + b.
#pragma once
#include <cmath>
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/columns.hpp"

namespace zoo {

// One row. Plain loops over pointers so Clad can differentiate it; mean and rstd are
// written out because the hand-written pullback reuses them. The arrays are restrict: Clad
// copies the qualifier into the gradient, whose loops then need no alias checks (rope.hpp).
inline void layernorm_forward_row(const float* __restrict__ x, const float* __restrict__ w,
                                  const float* __restrict__ b, float* __restrict__ y, float* mean_out,
                                  float* rstd_out, int C, float eps) {
    float sum = 0.0f;
    for (int i = 0; i < C; i++) sum += x[i];
    float mean = sum / C;
    float sq = 0.0f;
    for (int i = 0; i < C; i++) sq += (x[i] - mean) * (x[i] - mean);
    float rstd = 1.0f / std::sqrt(sq / C + eps);
    for (int i = 0; i < C; i++) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
    mean_out[0] = mean;
    rstd_out[0] = rstd;
}

// One row of the hand-written pullback: adds into dx and into this thread's dw, db sums. A
// function of its own with restrict pointers: g++ vectorizes it here, and not inlined in the
// parallel loop (too many alias checks between three outputs and four inputs).
inline void layernorm_pullback_row(const float* __restrict__ x, const float* __restrict__ w, float mean,
                                   float rstd, const float* __restrict__ dy, float* __restrict__ dx,
                                   float* __restrict__ dw, float* __restrict__ db, int C) {
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int i = 0; i < C; i++) {
        const float g = dy[i] * w[i];
        sum_g += g;
        sum_gx += g * (x[i] - mean) * rstd;
    }
    const float mean_g = sum_g / C, mean_gx = sum_gx / C;
    for (int i = 0; i < C; i++) {
        const float xhat = (x[i] - mean) * rstd;
        dx[i] += rstd * (dy[i] * w[i] - mean_g - xhat * mean_gx);
        dw[i] += dy[i] * xhat;
        db[i] += dy[i];
    }
}

struct LayerNorm {
    int C;
    float eps;

    // x, y: (N, C); mean, rstd: (N) saved for the pullback.
    void forward(const float* x, const float* w, const float* b, float* y, float* mean,
                 float* rstd, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            layernorm_forward_row(x + (size_t)n * C, w, b, y + (size_t)n * C, mean + n, rstd + n,
                                  C, eps);
    }

    // Adds into dx; writes or adds dw, db per mode. One pass over x and dy: each thread takes a
    // range of rows and sums its part of dw, db into its own slice of scratch (scratch_floats),
    // added up at the end.
    size_t scratch_floats(int threads) const { return (size_t)threads * 2 * C; }
    void pullback(const float* x, const float* w, const float* mean, const float* rstd,
                  const float* dy, float* dx, float* dw, float* db, float* scratch, int N,
                  GradMode mode) const {
#pragma omp parallel
        {
            const int threads = omp_get_num_threads();
            float* dw_t = scratch + (size_t)omp_get_thread_num() * 2 * C;
            float* db_t = dw_t + C;
            for (int i = 0; i < 2 * C; i++) dw_t[i] = 0.0f;
            if (mode == GradMode::write) {
#pragma omp for schedule(static) nowait
                for (int i = 0; i < C; i++) dw[i] = db[i] = 0.0f;
            }
#pragma omp for schedule(static)
            for (int n = 0; n < N; n++)
                layernorm_pullback_row(x + (size_t)n * C, w, mean[n], rstd[n], dy + (size_t)n * C,
                                       dx + (size_t)n * C, dw_t, db_t, C);
            add_thread_parts(dw, scratch, 2 * (size_t)C, threads, C);
            add_thread_parts(db, scratch + C, 2 * (size_t)C, threads, C);
        }
    }

    // The Clad backend's pullback: Clad's gradient of layernorm_forward_row, rows in parallel
    // (defined below, compiled only into a Clad build). Same contract as pullback; it replays
    // the row instead of reading mean and rstd, so it takes b, and the replay's output goes to
    // y (null: to scratch). scratch: clad_scratch_floats().
    size_t clad_row_floats() const { return ((size_t)4 * C + 4 + 15) / 16 * 16; }
    size_t clad_scratch_floats(int threads) const { return (size_t)threads * clad_row_floats(); }
    void pullback_clad(const float* x, const float* w, const float* b, const float* dy, float* y, float* dx,
                       float* dw, float* db, float* scratch, int N, GradMode mode) const;
};

// The registry entry (native/blocks/registry.hpp). Statistics: mean, then rstd.
void layernorm_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db,
                             float* scratch, GradMode mode);
inline const NormBlock layernorm_block{
    "layernorm", /*bias=*/true, /*stats_per_row=*/2,
    [](const NormArgs& a, float* y) { LayerNorm{a.C, a.eps}.forward(a.x, a.w, a.b, y, a.stats, a.stats + a.N, a.N); },
    [](const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db, float* scratch, GradMode mode) {
        const LayerNorm ln{a.C, a.eps};
        if (y) ln.forward(a.x, a.w, a.b, y, a.stats, a.stats + a.N, a.N);
        ln.pullback(a.x, a.w, a.stats, a.stats + a.N, dy, dx, dw, db, scratch, a.N, mode);
    },
    [](int C, int threads) { return LayerNorm{C, 0.0f}.scratch_floats(threads); },
    ZOO_CLAD_FN(layernorm_pullback_clad),
    [](int C, int threads) { return LayerNorm{C, 0.0f}.clad_scratch_floats(threads); },
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Per thread: [dw part (C) | db part (C) | y row (C) | seed (C) | mean, rstd, their adjoints].
void zoo::LayerNorm::pullback_clad(const float* x, const float* w, const float* b, const float* dy, float* y,
                                   float* dx, float* dw, float* db, float* scratch, int N,
                                   GradMode mode) const {
    const size_t S = clad_row_floats();
    if (mode == GradMode::write)  // the gradient adds
        for (int i = 0; i < C; i++) dw[i] = db[i] = 0.0f;
    int threads = 1;
#pragma omp parallel
    {
        auto grad = clad::gradient(layernorm_forward_row, "x, w, b, y, mean_out, rstd_out");
#pragma omp single
        threads = omp_get_num_threads();
        float* s = scratch + omp_get_thread_num() * S;
        float *dw_t = s, *db_t = s + C, *y_row = s + 2 * C, *seed = s + 3 * C, *st = s + 4 * C;
        for (int i = 0; i < 2 * C; i++) s[i] = 0.0f;
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* dyr = dy + (size_t)n * C;
            for (int i = 0; i < C; i++) seed[i] = dyr[i];  // the gradient consumes its seed
            st[2] = st[3] = 0.0f;                            // mean, rstd: nothing reads them
            grad.execute(x + (size_t)n * C, w, b, y ? y + (size_t)n * C : y_row, st, st + 1, C, eps,
                         dx + (size_t)n * C, dw_t, db_t, seed, st + 2, st + 3);
        }
        add_thread_parts(dw, scratch, S, threads, C);
        add_thread_parts(db, scratch + C, S, threads, C);
    }
}

void zoo::layernorm_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db,
                                  float* scratch, GradMode mode) {
    LayerNorm{a.C, a.eps}.pullback_clad(a.x, a.w, a.b, dy, y, dx, dw, db, scratch, a.N, mode);
}
#endif
