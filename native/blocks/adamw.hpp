// AdamW, one pass over a contiguous parameter range: moments, bias correction, decoupled
// weight decay and the update together, so each float is read and written once.
#pragma once
#include <cmath>
#include <cstddef>

namespace zoo {

struct AdamW {
    float lr, beta1, beta2, eps, weight_decay;

    // step counts from 1. grad_scale multiplies the gradient (global-norm clipping). Consumes
    // the gradient: each g[i] is set to zero once read, so the next step's pullbacks add into
    // zeros (their GEMMs then skip the BLAS's zero-fill for beta = 0, a pass over every
    // gradient); the store costs AdamW little, since the line is already in cache.
    void update(float* p, float* g, float* m, float* v, size_t n, int step, bool decay,
                float grad_scale) const {
        const float c1 = 1.0f / (1.0f - std::pow(beta1, (float)step));
        const float c2 = 1.0f / (1.0f - std::pow(beta2, (float)step));
        const float wd = decay ? lr * weight_decay : 0.0f;
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)n; i++) {
            float gi = g[i] * grad_scale;
            g[i] = 0.0f;
            m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
            v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
            p[i] -= lr * (m[i] * c1) / (std::sqrt(v[i] * c2) + eps) + wd * p[i];
        }
    }
};

}  // namespace zoo
