// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w.
#pragma once
#include <cmath>

namespace zoo {

inline void rmsnorm_forward_row(const float* x, const float* w, float* y, float* rstd_out, int C,
                                float eps) {
    float sq = 0.0f;
    for (int i = 0; i < C; i++) sq += x[i] * x[i];
    float rstd = 1.0f / std::sqrt(sq / C + eps);
    for (int i = 0; i < C; i++) y[i] = x[i] * rstd * w[i];
    rstd_out[0] = rstd;
}

struct RMSNorm {
    int C;
    float eps;

    void forward(const float* x, const float* w, float* y, float* rstd, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            rmsnorm_forward_row(x + (size_t)n * C, w, y + (size_t)n * C, rstd + n, C, eps);
    }

    // Adds into dx and dw.
    void pullback(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                  float* dw, int N) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float* xr = x + (size_t)n * C;
            const float* dyr = dy + (size_t)n * C;
            float* dxr = dx + (size_t)n * C;
            float r = rstd[n];
            float sum_gx = 0.0f;
            for (int i = 0; i < C; i++) sum_gx += dyr[i] * w[i] * xr[i];
            float k = r * r * r * sum_gx / C;
            for (int i = 0; i < C; i++) dxr[i] += r * dyr[i] * w[i] - k * xr[i];
        }
        const int block = 64;
#pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < C; c0 += block) {
            int c1 = c0 + block < C ? c0 + block : C;
            for (int n = 0; n < N; n++) {
                const float* xr = x + (size_t)n * C;
                const float* dyr = dy + (size_t)n * C;
                float r = rstd[n];
                for (int i = c0; i < c1; i++) dw[i] += dyr[i] * xr[i] * r;
            }
        }
    }
};

}  // namespace zoo
