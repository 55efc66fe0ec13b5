// Linear layer through BLAS: y = x W^T + b, W stored (out, in) like torch.nn.Linear.
#pragma once
#include <cstddef>
#include <cstring>

#include "../blas.hpp"

namespace zoo {

struct Linear {
    int in, out;

    // x: (N, in); y: (N, out); b may be null. accumulate=true adds into y (fuses the
    // residual add: y already holds the residual stream).
    void forward(const float* x, const float* W, const float* b, float* y, int N,
                 bool accumulate = false) const {
        float beta = accumulate ? 1.0f : 0.0f;
        if (b) {
#pragma omp parallel for schedule(static)
            for (int n = 0; n < N; n++) {
                float* yr = y + (size_t)n * out;
                if (accumulate)
                    for (int o = 0; o < out; o++) yr[o] += b[o];
                else
                    std::memcpy(yr, b, sizeof(float) * out);
            }
            beta = 1.0f;
        }
        blas::gemm(false, true, N, out, in, 1.0f, x, in, W, in, beta, y, out);
    }

    // dx = dy W (added into dx when accumulate_dx, else written; dx may be null),
    // dW += dy^T x, db += column sums of dy (db may be null).
    void pullback(const float* x, const float* W, const float* dy, float* dx, float* dW,
                  float* db, int N, bool accumulate_dx = false) const {
        if (dx) blas::gemm(false, false, N, in, out, 1.0f, dy, out, W, in,
                           accumulate_dx ? 1.0f : 0.0f, dx, in);
        blas::gemm(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dW, in);
        if (db) {
            const int block = 64;
#pragma omp parallel for schedule(static)
            for (int o0 = 0; o0 < out; o0 += block) {
                int o1 = o0 + block < out ? o0 + block : out;
                for (int n = 0; n < N; n++) {
                    const float* dyr = dy + (size_t)n * out;
                    for (int o = o0; o < o1; o++) db[o] += dyr[o];
                }
            }
        }
    }
};

}  // namespace zoo
