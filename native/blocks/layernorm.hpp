// LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * w + b.
#pragma once
#include <cmath>
#include <cstddef>

#include "../clad_backend.hpp"
#include "../columns.hpp"

namespace zoo {

// One row. Plain loops over pointers so Clad can differentiate it; mean and rstd are
// written out because the hand-written pullback reuses them.
inline void layernorm_forward_row(const float* x, const float* w, const float* b, float* y,
                                  float* mean_out, float* rstd_out, int C, float eps) {
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

    // Adds into dx; adds into dw, db (writes them with accumulate_params=false). Rows in
    // parallel for dx; column blocks in parallel for dw, db so no two threads write the same
    // weight gradient.
    void pullback(const float* x, const float* w, const float* mean, const float* rstd,
                  const float* dy, float* dx, float* dw, float* db, int N,
                  bool accumulate_params = true) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* xr = x + (size_t)n * C;
            const float* dyr = dy + (size_t)n * C;
            float* dxr = dx + (size_t)n * C;
            float m = mean[n], r = rstd[n];
            float sum_g = 0.0f, sum_gx = 0.0f;
            for (int i = 0; i < C; i++) {
                float g = dyr[i] * w[i];
                sum_g += g;
                sum_gx += g * (xr[i] - m) * r;
            }
            float mean_g = sum_g / C, mean_gx = sum_gx / C;
            for (int i = 0; i < C; i++) {
                float xhat = (xr[i] - m) * r;
                dxr[i] += r * (dyr[i] * w[i] - mean_g - xhat * mean_gx);
            }
        }
        const int block = column_block(C);
#pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < C; c0 += block) {
            int c1 = c0 + block < C ? c0 + block : C;
            if (!accumulate_params)
                for (int i = c0; i < c1; i++) dw[i] = db[i] = 0.0f;
            for (int n = 0; n < N; n++) {
                const float* xr = x + (size_t)n * C;
                const float* dyr = dy + (size_t)n * C;
                float m = mean[n], r = rstd[n];
                for (int i = c0; i < c1; i++) {
                    dw[i] += dyr[i] * (xr[i] - m) * r;
                    db[i] += dyr[i];
                }
            }
        }
    }

    // The Clad backend's pullback: Clad's gradient of layernorm_forward_row, rows in parallel
    // (defined below, compiled only into a Clad build). Same contract as pullback; it replays
    // the row instead of reading mean and rstd, so it takes b. scratch: clad_scratch_floats().
    size_t clad_row_floats() const { return ((size_t)4 * C + 4 + 15) / 16 * 16; }
    size_t clad_scratch_floats(int threads) const { return (size_t)threads * clad_row_floats(); }
    void pullback_clad(const float* x, const float* w, const float* b, const float* dy, float* dx,
                       float* dw, float* db, float* scratch, int N) const;
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Per thread: [dw part (C) | db part (C) | y (C) | seed (C) | mean, rstd, their adjoints].
void zoo::LayerNorm::pullback_clad(const float* x, const float* w, const float* b, const float* dy,
                                   float* dx, float* dw, float* db, float* scratch, int N) const {
    const size_t S = clad_row_floats();
    int threads = 1;
#pragma omp parallel
    {
        auto grad = clad::gradient(layernorm_forward_row, "x, w, b, y, mean_out, rstd_out");
#pragma omp single
        threads = omp_get_num_threads();
        float* s = scratch + omp_get_thread_num() * S;
        float *dw_t = s, *db_t = s + C, *y = s + 2 * C, *seed = s + 3 * C, *st = s + 4 * C;
        for (int i = 0; i < 2 * C; i++) s[i] = 0.0f;
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* dyr = dy + (size_t)n * C;
            for (int i = 0; i < C; i++) seed[i] = dyr[i];  // the gradient consumes its seed
            st[2] = st[3] = 0.0f;                            // mean, rstd: nothing reads them
            grad.execute(x + (size_t)n * C, w, b, y, st, st + 1, C, eps, dx + (size_t)n * C, dw_t,
                         db_t, seed, st + 2, st + 3);
        }
        add_thread_parts(dw, scratch, S, threads, C);
        add_thread_parts(db, scratch + C, S, threads, C);
    }
}
#endif
