// Rotary position embedding, rotate-half convention (Hugging Face Llama): for i < h = hd/2,
// (x_i, x_{i+h}) -> (x_i cos - x_{i+h} sin, x_{i+h} cos + x_i sin), angle = pos * inv_freq[i].
// inv_freq comes from the config (theta, Llama-3 scaling) and is turned into cos/sin tables once.
#pragma once
#include <cmath>
#include <cstddef>

#include "../block.hpp"
#include "../clad_backend.hpp"

namespace zoo {

// The tables are restrict: Clad copies the qualifier into the gradient, whose reverse loop
// clears each adjoint before adding into it; without it clang must keep those stores ahead of
// the table loads (1.45x the hand-written pullback instead of 1.1x, docs/clad.md).
inline void rope_forward_row(float* x, const float* __restrict__ cos_row, const float* __restrict__ sin_row,
                             int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos_row[i] - b * sin_row[i];
        x[i + half] = b * cos_row[i] + a * sin_row[i];
    }
}

struct RoPE {
    int head_dim;

    // Fills cos/sin tables (max_pos, head_dim/2) from inv_freq, in float32 as transformers does.
    void build_tables(const float* inv_freq, float* cos_t, float* sin_t, int max_pos) const {
        int half = head_dim / 2;
        for (int p = 0; p < max_pos; p++)
            for (int i = 0; i < half; i++) {
                float angle = (float)p * inv_freq[i];
                cos_t[(size_t)p * half + i] = std::cos(angle);
                sin_t[(size_t)p * half + i] = std::sin(angle);
            }
    }

    // In place on the first n_heads heads of each row of x (row stride `stride` floats):
    // used on q and k inside the fused qkv rows. Row n's position: position_of (block.hpp).
    void forward(float* x, int stride, int n_heads, const float* cos_t, const float* sin_t,
                 int B, int T, const int32_t* positions, int pos0 = 0) const {
        int half = head_dim / 2;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < B * T; n++) {
            size_t p = (size_t)position_of(positions, n, T, pos0) * half;
            for (int h = 0; h < n_heads; h++)
                rope_forward_row(x + (size_t)n * stride + h * head_dim, cos_t + p, sin_t + p, half);
        }
    }

    // The rotation is orthogonal: the pullback rotates the adjoint back, in place.
    void pullback(float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t,
                  int B, int T, const int32_t* positions) const {
        int half = head_dim / 2;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < B * T; n++) {
            const float* c = cos_t + (size_t)position_of(positions, n, T) * half;
            const float* s = sin_t + (size_t)position_of(positions, n, T) * half;
            for (int h = 0; h < n_heads; h++) {
                float* d = dx + (size_t)n * stride + h * head_dim;
                for (int i = 0; i < half; i++) {
                    float a = d[i], b = d[i + half];
                    d[i] = a * c[i] + b * s[i];
                    d[i + half] = b * c[i] - a * s[i];
                }
            }
        }
    }

    // The Clad backend's pullback: Clad's gradient of rope_forward_row, in place on the
    // adjoint like pullback (defined below, compiled only into a Clad build). The rotation is
    // linear, so the replayed forward's input does not matter: it rotates a zero row in
    // scratch (clad_scratch_floats()) instead of the saved q and k.
    size_t clad_scratch_floats(int threads) const { return (size_t)threads * (((size_t)head_dim + 15) / 16 * 16); }
    void pullback_clad(float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t,
                       int B, int T, const int32_t* positions, float* scratch) const;
};

// The registry entry (native/registry.hpp): in place on the adjoint.
using RopePullback = void (*)(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t,
                              const float* sin_t, int B, int T, const int32_t* positions, float* scratch);
void rope_pullback_clad(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t,
                        int B, int T, const int32_t* positions, float* scratch);
inline const FixedBlock<RopePullback> rope_block{
    "rope",
    [](const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t, int B, int T,
       const int32_t* positions, float*) { r.pullback(dx, stride, n_heads, cos_t, sin_t, B, T, positions); },
    ZOO_CLAD_FN(rope_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
void zoo::RoPE::pullback_clad(float* dx, int stride, int n_heads, const float* cos_t,
                              const float* sin_t, int B, int T, const int32_t* positions, float* scratch) const {
    const int half = head_dim / 2;
#pragma omp parallel
    {
        auto grad = clad::gradient(rope_forward_row, "x");
        float* x = scratch + omp_get_thread_num() * clad_pad(head_dim);
        for (int i = 0; i < head_dim; i++) x[i] = 0.0f;
#pragma omp for schedule(static)
        for (int n = 0; n < B * T; n++) {
            const size_t p = (size_t)position_of(positions, n, T) * half;
            for (int h = 0; h < n_heads; h++)
                grad.execute(x, cos_t + p, sin_t + p, half, dx + (size_t)n * stride + h * head_dim);
        }
    }
}

void zoo::rope_pullback_clad(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t,
                             const float* sin_t, int B, int T, const int32_t* positions, float* scratch) {
    r.pullback_clad(dx, stride, n_heads, cos_t, sin_t, B, T, positions, scratch);
}
#endif
