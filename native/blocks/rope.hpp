// Rotary position embedding, rotate-half convention (Hugging Face Llama): for i < h = hd/2,
// (x_i, x_{i+h}) -> (x_i cos - x_{i+h} sin, x_{i+h} cos + x_i sin), angle = pos * inv_freq[i].
// inv_freq comes from the config (theta, Llama-3 scaling) and is turned into cos/sin tables once.
// Partial rotary (GPT-NeoX, Phi): only the first rotary_dim values of each head rotate, pairing
// i with i + rotary_dim/2; the rest pass through.
#pragma once
#include <cmath>
#include <cstddef>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"

namespace zoo {

// One rotated pair as a scalar function, the Clad backend's unit (as the activations'
// element functions are): its gradient is inlined into a loop of the same shape as the
// forward's, and the replayed rotation, dead scalars, is dropped by the compiler. Clad's
// gradient of the whole in-place row replayed the rotation into a scratch row before its
// reverse loop (1.4-1.5x the hand-written pullback at two threads, docs/clad.md).
inline void rope_rotate_pair(float a, float b, float c, float s, float& out_a, float& out_b) {
    out_a = a * c - b * s;
    out_b = b * c + a * s;
}

inline void rope_forward_row(float* x, const float* __restrict__ cos_row, const float* __restrict__ sin_row,
                             int half) {
    for (int i = 0; i < half; i++) rope_rotate_pair(x[i], x[i + half], cos_row[i], sin_row[i], x[i], x[i + half]);
}

// One head's adjoint rotated back, in place. Restrict pointers: the tables are never the
// adjoint, so the compiler need not check at run time whether stores to it change them.
inline void rope_pullback_head(float* __restrict__ d, const float* __restrict__ cos_row,
                               const float* __restrict__ sin_row, int half) {
    for (int i = 0; i < half; i++) {
        const float a = d[i], b = d[i + half];
        d[i] = a * cos_row[i] + b * sin_row[i];
        d[i + half] = b * cos_row[i] - a * sin_row[i];
    }
}

struct RoPE {
    int head_dim;
    int rotary_dim = 0;  // 0: the whole head
    int half() const { return (rotary_dim ? rotary_dim : head_dim) / 2; }

    // Fills cos/sin tables (max_pos, half()) from inv_freq, in float32 as transformers does.
    void build_tables(const float* inv_freq, float* cos_t, float* sin_t, int max_pos) const {
        const int half = this->half();
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
        const int half = this->half();
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
        const int half = this->half();
#pragma omp parallel for schedule(static)
        for (int n = 0; n < B * T; n++) {
            const size_t p = (size_t)position_of(positions, n, T) * half;
            for (int h = 0; h < n_heads; h++)
                rope_pullback_head(dx + (size_t)n * stride + h * head_dim, cos_t + p, sin_t + p, half);
        }
    }

    // The Clad backend's pullback: Clad's gradient of rope_rotate_pair, in place on the adjoint
    // like pullback (defined below, compiled only into a Clad build). The rotation is linear,
    // so its partials do not depend on the rotated values: the saved q and k are not read.
    void pullback_clad(float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t,
                       int B, int T, const int32_t* positions) const;
};

// The registry entry (native/blocks/registry.hpp): in place on the adjoint.
using RopePullback = void (*)(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t,
                              const float* sin_t, int B, int T, const int32_t* positions);
void rope_pullback_clad(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t,
                        int B, int T, const int32_t* positions);
inline const FixedBlock<RopePullback> rope_block{
    "rope",
    [](const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t, int B, int T,
       const int32_t* positions) { r.pullback(dx, stride, n_heads, cos_t, sin_t, B, T, positions); },
    ZOO_CLAD_FN(rope_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace zoo {
// One head's adjoint, rotated back in place: the pair gradient per element. A function of
// its own with restrict pointers, as gated_pullback_row (activation.hpp).
inline void rope_pullback_head_clad(float* __restrict__ d, const float* __restrict__ cos_row,
                                    const float* __restrict__ sin_row, int half) {
    auto gradient = clad::gradient(rope_rotate_pair, "a, b, out_a, out_b");
    for (int i = 0; i < half; i++) {
        float da = 0.0f, db = 0.0f, out_a, out_b, d_out_a = d[i], d_out_b = d[i + half];
        gradient.execute(0.0f, 0.0f, cos_row[i], sin_row[i], out_a, out_b, &da, &db, &d_out_a, &d_out_b);
        d[i] = da;
        d[i + half] = db;
    }
}
}  // namespace zoo

void zoo::RoPE::pullback_clad(float* dx, int stride, int n_heads, const float* cos_t, const float* sin_t, int B,
                              int T, const int32_t* positions) const {
    const int half = this->half();
#pragma omp parallel for schedule(static)
    for (int n = 0; n < B * T; n++) {
        const size_t p = (size_t)position_of(positions, n, T) * half;
        for (int h = 0; h < n_heads; h++)
            rope_pullback_head_clad(dx + (size_t)n * stride + h * head_dim, cos_t + p, sin_t + p, half);
    }
}

void zoo::rope_pullback_clad(const RoPE& r, float* dx, int stride, int n_heads, const float* cos_t,
                             const float* sin_t, int B, int T, const int32_t* positions) {
    r.pullback_clad(dx, stride, n_heads, cos_t, sin_t, B, T, positions);
}
#endif
