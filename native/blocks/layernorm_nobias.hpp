// LayerNorm without a bias: y = (x - mean) / sqrt(var + eps) * w (OLMo's and PaLM's choice;
// torch.nn.LayerNorm(bias=False)). ModelConfig(norm="layernorm_nobias"). The worked example of
// docs/adding_a_block.md: this header and one line in native/blocks/registry.hpp are all of its
// native side.
#pragma once
#include <cmath>
#include <cstddef>

#include <omp.h>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/columns.hpp"

namespace zoo {

// One row, plain loops over pointers so Clad can differentiate it; mean and rstd written out
// for the hand-written pullback.
inline void layernorm_nobias_forward_row(const float* x, const float* w, float* y, float* mean_out,
                                         float* rstd_out, int C, float eps) {
    float sum = 0.0f;
    for (int i = 0; i < C; i++) sum += x[i];
    float mean = sum / C;
    float sq = 0.0f;
    for (int i = 0; i < C; i++) sq += (x[i] - mean) * (x[i] - mean);
    float rstd = 1.0f / std::sqrt(sq / C + eps);
    for (int i = 0; i < C; i++) y[i] = (x[i] - mean) * rstd * w[i];
    mean_out[0] = mean;
    rstd_out[0] = rstd;
}

// One row of the hand-written pullback: adds into dx and into this thread's dw sums.
// xhat = (x - mean) rstd; dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w.
inline void layernorm_nobias_pullback_row(const float* __restrict__ x, const float* __restrict__ w, float mean,
                                          float rstd, const float* __restrict__ dy, float* __restrict__ dx,
                                          float* __restrict__ dw, int C) {
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
    }
}

// stats: mean (N), then rstd (N).
inline void layernorm_nobias_forward(const NormArgs& a, float* y) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < a.N; n++)
        layernorm_nobias_forward_row(a.x + (size_t)n * a.C, a.w, y + (size_t)n * a.C, a.stats + n,
                                     a.stats + a.N + n, a.C, a.eps);
}

// Adds into dx; writes or adds dw per mode, through per-thread partial sums in scratch added in
// thread order (reproducible).
inline void layernorm_nobias_pullback(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float*,
                                      float* scratch, GradMode mode) {
    const int C = a.C;
    if (y) layernorm_nobias_forward(a, y);
#pragma omp parallel
    {
        const int threads = omp_get_num_threads();
        float* dw_t = scratch + (size_t)omp_get_thread_num() * C;
        for (int i = 0; i < C; i++) dw_t[i] = 0.0f;
        if (mode == GradMode::write) {
#pragma omp for schedule(static) nowait
            for (int i = 0; i < C; i++) dw[i] = 0.0f;
        }
#pragma omp for schedule(static)
        for (int n = 0; n < a.N; n++)
            layernorm_nobias_pullback_row(a.x + (size_t)n * C, a.w, a.stats[n], a.stats[a.N + n], dy + (size_t)n * C,
                                          dx + (size_t)n * C, dw_t, C);
        add_thread_parts(dw, scratch, C, threads, C);
    }
}

// Per thread: [dw part | y row | seed | mean, rstd, their adjoints], padded to 16 floats.
inline size_t layernorm_nobias_clad_row_floats(int C) { return clad_pad(3 * (size_t)C + 4); }
void layernorm_nobias_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db,
                                    float* scratch, GradMode mode);

inline const NormBlock layernorm_nobias_block{
    "layernorm_nobias", /*bias=*/false, /*stats_per_row=*/2,
    layernorm_nobias_forward,
    layernorm_nobias_pullback,
    [](int C, int threads) { return (size_t)threads * C; },
    ZOO_CLAD_FN(layernorm_nobias_pullback_clad),
    [](int C, int threads) { return (size_t)threads * layernorm_nobias_clad_row_floats(C); },
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Clad's gradient of the row kernel, rows in parallel; the gradient adds, so writing clears dw.
// The replay's output goes to y (null: to scratch).
void zoo::layernorm_nobias_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float*,
                                         float* scratch, GradMode mode) {
    const int C = a.C;
    const size_t S = layernorm_nobias_clad_row_floats(C);
    if (mode == GradMode::write)
        for (int i = 0; i < C; i++) dw[i] = 0.0f;
    int threads = 1;
#pragma omp parallel
    {
        auto grad = clad::gradient(layernorm_nobias_forward_row, "x, w, y, mean_out, rstd_out");
#pragma omp single
        threads = omp_get_num_threads();
        float* s = scratch + omp_get_thread_num() * S;
        float *dw_t = s, *y_row = s + C, *seed = s + 2 * C, *st = s + 3 * C;
        for (int i = 0; i < C; i++) dw_t[i] = 0.0f;
#pragma omp for schedule(static)
        for (int n = 0; n < a.N; n++) {
            const float* dyr = dy + (size_t)n * C;
            for (int i = 0; i < C; i++) seed[i] = dyr[i];  // the gradient consumes its seed
            st[2] = st[3] = 0.0f;                            // mean, rstd: nothing reads them
            grad.execute(a.x + (size_t)n * C, a.w, y ? y + (size_t)n * C : y_row, st, st + 1, C, a.eps,
                         dx + (size_t)n * C, dw_t, seed, st + 2, st + 3);
        }
        add_thread_parts(dw, scratch, S, threads, C);
    }
}
#endif
