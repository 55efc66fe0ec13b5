// Residual add: y = a + b. Most residual adds are fused into Linear (accumulate=true); this
// block serves the places where both sides are activations.
#pragma once
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"

namespace zoo {

inline void residual_forward_row(const float* a, const float* b, float* y, int n) {
    for (int i = 0; i < n; i++) y[i] = a[i] + b[i];
}

struct Residual {
    static constexpr int chunk = 4096;  // elements per parallel task

    void forward(const float* a, const float* b, float* y, size_t n) const {
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)n; i += chunk)
            residual_forward_row(a + i, b + i, y + i, (int)(n - i < (size_t)chunk ? n - i : chunk));
    }

    // The adjoint passes through to both inputs: adds dy into da and db.
    void pullback(const float* dy, float* da, float* db, size_t n) const {
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)n; i++) {
            da[i] += dy[i];
            db[i] += dy[i];
        }
    }

    // The Clad backend's pullback: Clad's gradient of residual_forward_row, chunks in
    // parallel (defined below, compiled only into a Clad build). The replayed forward reads
    // a and b. The executor fuses the residual adds into the linear layers and carries the
    // adjoint through, so only the block-level API calls this.
    void pullback_clad(const float* a, const float* b, const float* dy, float* da, float* db,
                       size_t n) const;
};

// The registry entry (native/blocks/registry.hpp): pullbacks at the block level only.
using ResidualPullback = void (*)(const float* a, const float* b, const float* dy, float* da, float* db, size_t n);
void residual_pullback_clad(const float* a, const float* b, const float* dy, float* da, float* db, size_t n);
inline const FixedBlock<ResidualPullback> residual_block{
    "residual",
    [](const float*, const float*, const float* dy, float* da, float* db, size_t n) {
        Residual{}.pullback(dy, da, db, n);
    },
    ZOO_CLAD_FN(residual_pullback_clad),
    /*in_step=*/false,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
void zoo::Residual::pullback_clad(const float* a, const float* b, const float* dy, float* da,
                                  float* db, size_t n) const {
#pragma omp parallel
    {
        auto grad = clad::gradient(residual_forward_row, "a, b, y");
        float y[chunk], seed[chunk];
#pragma omp for schedule(static)
        for (long i = 0; i < (long)n; i += chunk) {
            const int len = (int)(n - i < (size_t)chunk ? n - i : chunk);
            for (int j = 0; j < len; j++) seed[j] = dy[i + j];  // the gradient consumes its seed
            grad.execute(a + i, b + i, y, len, da + i, db + i, seed);
        }
    }
}

void zoo::residual_pullback_clad(const float* a, const float* b, const float* dy, float* da, float* db, size_t n) {
    Residual{}.pullback_clad(a, b, dy, da, db, n);
}
#endif
