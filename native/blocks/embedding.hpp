// Token embedding plus optional learned position embedding: x[b,t] = wte[tok[b,t]] + wpe[position of (b,t)].
#pragma once
#include <cstddef>
#include <cstdint>

#include <cstring>
#include <stdexcept>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/quant.hpp"

namespace zoo {

// The elements as scalar functions, the Clad backend's unit (as the activations' are): their
// gradients are inlined into the hand-written pullback's loop, where their constant partials
// leave one add per element. Clad's gradient of a whole row replayed the sum, reading the
// gathered wte and wpe rows for nothing (1.35-1.5x the hand-written pullback, docs/clad.md).
inline float embedding_sum(float token, float position) { return token + position; }
// Token embedding alone (RoPE models).
inline float token_embedding(float token) { return token; }

inline void embedding_forward_row(const float* wte_row, const float* wpe_row, float* x, int C) {
    for (int i = 0; i < C; i++) x[i] = embedding_sum(wte_row[i], wpe_row[i]);
}

inline void token_embedding_forward_row(const float* wte_row, float* x, int C) {
    for (int i = 0; i < C; i++) x[i] = token_embedding(wte_row[i]);
}

struct Embedding {
    int C;
    int vocab = 0, max_pos = 0;  // rows of wte and wpe: what a pullback that writes clears

    // tokens: (B, T); x: (B*T, C). wpe may be null (RoPE models). positions: see
    // position_of (block.hpp); pos0 offsets the default ones (generation with a KV cache).
    void forward(const int32_t* tokens, const int32_t* positions, const float* wte, const float* wpe, float* x,
                 int B, int T, int pos0 = 0) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < B * T; n++) {
            const float* te = wte + (size_t)tokens[n] * C;
            float* xr = x + (size_t)n * C;
            if (wpe) {
                embedding_forward_row(te, wpe + (size_t)position_of(positions, n, T, pos0) * C, xr, C);
            } else {
                token_embedding_forward_row(te, xr, C);
            }
        }
    }

    // The same with wte in a storage format (quant.hpp: a frozen base): each row widened.
    void forward(const int32_t* tokens, const int32_t* positions, const Matrix& wte, const float* wpe, float* x,
                 int B, int T, int pos0 = 0) const {
        if (wte.dtype == DType::f32) return forward(tokens, positions, wte.f32(), wpe, x, B, T, pos0);
#pragma omp parallel for schedule(static)
        for (int n = 0; n < B * T; n++) {
            float* xr = x + (size_t)n * C;
            widen_row_range(wte, (size_t)tokens[n], 0, C, xr);
            if (wpe) {
                const float* pe = wpe + (size_t)position_of(positions, n, T, pos0) * C;
                for (int i = 0; i < C; i++) xr[i] += pe[i];
            }
        }
    }

    // Adds dx rows into the rows of dwte (and dwpe) they came from; a gradient whose mode is
    // write, into zeros (vocab and max_pos rows; a tied dwte already holds the LM head's part).
    // Column blocks in parallel: repeated tokens never race and the sum order is fixed.
    void pullback(const int32_t* tokens, const int32_t* positions, const float* dx, float* dwte, float* dwpe,
                  int B, int T, GradMode wte_mode, GradMode wpe_mode) const {
        clear_if_writing(dwte, dwpe, wte_mode, wpe_mode);
        const int block = 64;
#pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < C; c0 += block) {
            int c1 = c0 + block < C ? c0 + block : C;
            for (int n = 0; n < B * T; n++) {
                const float* dxr = dx + (size_t)n * C;
                float* dte = dwte + (size_t)tokens[n] * C;
                for (int i = c0; i < c1; i++) dte[i] += dxr[i];
                if (dwpe) {
                    float* dpe = dwpe + (size_t)position_of(positions, n, T) * C;
                    for (int i = c0; i < c1; i++) dpe[i] += dxr[i];
                }
            }
        }
    }

    // The Clad backend's pullback: Clad's gradients of the element functions, in the loops of
    // pullback (defined below, compiled only into a Clad build).
    void pullback_clad(const int32_t* tokens, const int32_t* positions, const float* wte, const float* wpe,
                       const float* dx, float* dwte, float* dwpe, int B, int T, GradMode wte_mode,
                       GradMode wpe_mode) const;

    void clear_if_writing(float* dwte, float* dwpe, GradMode wte_mode, GradMode wpe_mode) const {
        if ((wte_mode == GradMode::write && !vocab) || (dwpe && wpe_mode == GradMode::write && !max_pos))
            throw std::logic_error("zoo: an Embedding pullback that writes its gradients needs vocab and max_pos");
        if (wte_mode == GradMode::write) std::memset(dwte, 0, sizeof(float) * vocab * C);
        if (dwpe && wpe_mode == GradMode::write) std::memset(dwpe, 0, sizeof(float) * max_pos * C);
    }
};

// The registry entry (native/blocks/registry.hpp).
using EmbeddingPullback = void (*)(const Embedding& e, const int32_t* tokens, const int32_t* positions,
                                   const float* wte, const float* wpe, const float* dx, float* dwte, float* dwpe,
                                   int B, int T, GradMode wte_mode, GradMode wpe_mode);
void embedding_pullback_clad(const Embedding& e, const int32_t* tokens, const int32_t* positions, const float* wte,
                             const float* wpe, const float* dx, float* dwte, float* dwpe, int B, int T,
                             GradMode wte_mode, GradMode wpe_mode);
inline const FixedBlock<EmbeddingPullback> embedding_block{
    "embedding",
    [](const Embedding& e, const int32_t* tokens, const int32_t* positions, const float*, const float*,
       const float* dx, float* dwte, float* dwpe, int B, int T, GradMode wte_mode, GradMode wpe_mode) {
        e.pullback(tokens, positions, dx, dwte, dwpe, B, T, wte_mode, wpe_mode);
    },
    ZOO_CLAD_FN(embedding_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace zoo {
// One row's columns of the adjoint added into its token's (and position's) gradient row. A
// function of its own with restrict pointers, as gated_pullback_row (activation.hpp). The
// values are passed as the gradients take them; nothing reads them, so nothing loads them.
inline void embedding_pullback_cols_clad(const float* __restrict__ te, const float* __restrict__ pe,
                                         const float* __restrict__ dx, float* __restrict__ dte,
                                         float* __restrict__ dpe, int len) {
    if (dpe) {
        auto gradient = clad::gradient(embedding_sum);
        for (int i = 0; i < len; i++) {
            float d_token = 0.0f, d_position = 0.0f;  // the gradient adds into them
            gradient.execute(te[i], pe[i], &d_token, &d_position);
            dte[i] += dx[i] * d_token;
            dpe[i] += dx[i] * d_position;
        }
    } else {
        auto derivative = clad::differentiate(token_embedding, "token");
        for (int i = 0; i < len; i++) dte[i] += dx[i] * derivative.execute(te[i]);
    }
}
}  // namespace zoo

void zoo::Embedding::pullback_clad(const int32_t* tokens, const int32_t* positions, const float* wte,
                                   const float* wpe, const float* dx, float* dwte, float* dwpe, int B, int T,
                                   GradMode wte_mode, GradMode wpe_mode) const {
    clear_if_writing(dwte, dwpe, wte_mode, wpe_mode);
    const int block = 64;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += block) {
        const int len = c0 + block < C ? block : C - c0;
        for (int n = 0; n < B * T; n++) {
            const size_t te = (size_t)tokens[n] * C + c0, pe = (size_t)position_of(positions, n, T) * C + c0;
            embedding_pullback_cols_clad(wte + te, dwpe ? wpe + pe : nullptr, dx + (size_t)n * C + c0, dwte + te,
                                         dwpe ? dwpe + pe : nullptr, len);
        }
    }
}

void zoo::embedding_pullback_clad(const Embedding& e, const int32_t* tokens, const int32_t* positions,
                                  const float* wte, const float* wpe, const float* dx, float* dwte, float* dwpe,
                                  int B, int T, GradMode wte_mode, GradMode wpe_mode) {
    e.pullback_clad(tokens, positions, wte, wpe, dx, dwte, dwpe, B, T, wte_mode, wpe_mode);
}
#endif
