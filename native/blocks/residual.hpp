// Residual add: y = a + b. Most residual adds are fused into Linear (accumulate=true); this
// block serves the places where both sides are activations.
#pragma once
#include <cstddef>

namespace zoo {

struct Residual {
    void forward(const float* a, const float* b, float* y, size_t n) const {
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)n; i++) y[i] = a[i] + b[i];
    }

    // The adjoint passes through to both inputs: adds dy into da and db.
    void pullback(const float* dy, float* da, float* db, size_t n) const {
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)n; i++) {
            da[i] += dy[i];
            db[i] += dy[i];
        }
    }
};

}  // namespace zoo
