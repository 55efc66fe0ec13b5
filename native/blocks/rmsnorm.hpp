// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * (w + offset). Two registry
// entries: rmsnorm (offset 0, Llama) and rmsnorm_1p (offset 1: Gemma stores its norm weights
// around 0 and scales by 1 + w, computed in fp32 as transformers does).
#pragma once
#include <cmath>
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/columns.hpp"

namespace zoo {

inline void rmsnorm_forward_row(const float* x, const float* w, float* y, float* rstd_out, int C,
                                float eps, float offset) {
    float sq = 0.0f;
    for (int i = 0; i < C; i++) sq += x[i] * x[i];
    float rstd = 1.0f / std::sqrt(sq / C + eps);
    for (int i = 0; i < C; i++) y[i] = x[i] * rstd * (w[i] + offset);
    rstd_out[0] = rstd;
}

// One row of the hand-written pullback: adds into dx and into this thread's dw sums (a
// function of its own with restrict pointers so that it vectorizes, as layernorm_pullback_row).
inline void rmsnorm_pullback_row(const float* __restrict__ x, const float* __restrict__ w, float rstd,
                                 const float* __restrict__ dy, float* __restrict__ dx,
                                 float* __restrict__ dw, int C, float offset) {
    float sum_gx = 0.0f;
    for (int i = 0; i < C; i++) sum_gx += dy[i] * (w[i] + offset) * x[i];
    const float k = rstd * rstd * rstd * sum_gx / C;
    for (int i = 0; i < C; i++) {
        dx[i] += rstd * dy[i] * (w[i] + offset) - k * x[i];
        dw[i] += dy[i] * x[i] * rstd;
    }
}

struct RMSNorm {
    int C;
    float eps;
    float offset = 0.0f;

    void forward(const float* x, const float* w, float* y, float* rstd, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            rmsnorm_forward_row(x + (size_t)n * C, w, y + (size_t)n * C, rstd + n, C, eps, offset);
    }

    // Adds into dx; writes or adds dw per mode. One pass over x
    // and dy, as LayerNorm::pullback: per-thread partial sums of dw in scratch (scratch_floats).
    size_t scratch_floats(int threads) const { return (size_t)threads * C; }
    void pullback(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                  float* dw, float* scratch, int N, GradMode mode) const {
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
            for (int n = 0; n < N; n++)
                rmsnorm_pullback_row(x + (size_t)n * C, w, rstd[n], dy + (size_t)n * C, dx + (size_t)n * C,
                                     dw_t, C, offset);
            add_thread_parts(dw, scratch, C, threads, C);
        }
    }

    // The Clad backend's pullback: Clad's gradient of rmsnorm_forward_row, rows in parallel
    // (defined below, compiled only into a Clad build). Same contract as pullback; it replays
    // the row instead of reading rstd; the replay's output goes to y (null: to scratch).
    // scratch: clad_scratch_floats().
    size_t clad_row_floats() const { return ((size_t)3 * C + 2 + 15) / 16 * 16; }
    size_t clad_scratch_floats(int threads) const { return (size_t)threads * clad_row_floats(); }
    void pullback_clad(const float* x, const float* w, const float* dy, float* y, float* dx, float* dw,
                       float* scratch, int N, GradMode mode) const;
};

// The registry entry (native/blocks/registry.hpp). Statistics: rstd.
template <int Offset>
void rmsnorm_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db,
                           float* scratch, GradMode mode);
// The registry entries, one per offset (a NormBlock's functions take no state).
template <int Offset>
inline const NormBlock rmsnorm_entry{
    Offset ? "rmsnorm_1p" : "rmsnorm", /*bias=*/false, /*stats_per_row=*/1,
    [](const NormArgs& a, float* y) { RMSNorm{a.C, a.eps, Offset}.forward(a.x, a.w, y, a.stats, a.N); },
    [](const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float*, float* scratch, GradMode mode) {
        const RMSNorm rms{a.C, a.eps, Offset};
        if (y) rms.forward(a.x, a.w, y, a.stats, a.N);
        rms.pullback(a.x, a.w, a.stats, dy, dx, dw, scratch, a.N, mode);
    },
    [](int C, int threads) { return RMSNorm{C, 0.0f}.scratch_floats(threads); },
    ZOO_CLAD_FN(rmsnorm_pullback_clad<Offset>),
    [](int C, int threads) { return RMSNorm{C, 0.0f}.clad_scratch_floats(threads); },
};
inline const NormBlock& rmsnorm_block = rmsnorm_entry<0>;
inline const NormBlock& rmsnorm_1p_block = rmsnorm_entry<1>;

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Per thread: [dw part (C) | y row (C) | seed (C) | rstd, its adjoint].
void zoo::RMSNorm::pullback_clad(const float* x, const float* w, const float* dy, float* y, float* dx,
                                 float* dw, float* scratch, int N, GradMode mode) const {
    const size_t S = clad_row_floats();
    if (mode == GradMode::write)  // the gradient adds
        for (int i = 0; i < C; i++) dw[i] = 0.0f;
    int threads = 1;
#pragma omp parallel
    {
        auto grad = clad::gradient(rmsnorm_forward_row, "x, w, y, rstd_out");
#pragma omp single
        threads = omp_get_num_threads();
        float* s = scratch + omp_get_thread_num() * S;
        float *dw_t = s, *y_row = s + C, *seed = s + 2 * C, *st = s + 3 * C;
        for (int i = 0; i < C; i++) dw_t[i] = 0.0f;
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* dyr = dy + (size_t)n * C;
            for (int i = 0; i < C; i++) seed[i] = dyr[i];  // the gradient consumes its seed
            st[1] = 0.0f;
            grad.execute(x + (size_t)n * C, w, y ? y + (size_t)n * C : y_row, st, C, eps, offset, dx + (size_t)n * C,
                         dw_t, seed, st + 1);
        }
        add_thread_parts(dw, scratch, S, threads, C);
    }
}

template <int Offset>
void zoo::rmsnorm_pullback_clad(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float*,
                                float* scratch, GradMode mode) {
    RMSNorm{a.C, a.eps, Offset}.pullback_clad(a.x, a.w, dy, y, dx, dw, scratch, a.N, mode);
}
template void zoo::rmsnorm_pullback_clad<0>(const NormArgs&, const float*, float*, float*, float*, float*, float*,
                                            GradMode);
template void zoo::rmsnorm_pullback_clad<1>(const NormArgs&, const float*, float*, float*, float*, float*, float*,
                                            GradMode);
#endif
