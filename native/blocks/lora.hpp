// LoRA adapter (Hu et al. 2021), on a frozen linear layer: y += scale (x A^T) B^T, A (rank, in),
// B (out, rank), scale = alpha / rank. A fused layer (q|k|v, gate|up) carries one adapter per
// projection it targets, each on its own segment [o0, o1) of the layer's output columns; their
// A's are stacked (n_seg rank, in) so the first product is one GEMM, their B's stacked by
// segment. Dropout on the adapter's input (PEFT's lora_dropout) is its own pair below: the
// executor applies it, so the adapter's two pullbacks see the same input.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "blocks/block.hpp"
#include "kernels/gemm.hpp"

namespace zoo {

// h = scale x A^T: x (N, in), A (nr, in), h (N, nr).
inline void lora_down(const float* x, const float* A, float* h, int N, int in, int nr, float scale, int precision) {
    gemm::gemm((Precision)precision, false, true, N, nr, in, x, in, A, in, 0.0f, h, nr);
    const size_t n = (size_t)N * nr;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) h[i] *= scale;
}

// Segment j: y[:, o0:o1] += h[:, j rank:(j+1) rank] B_j^T, B_j the j-th (o1 - o0, rank) block of B.
inline size_t lora_b_offset(const int* seg, int j, int rank) {
    size_t at = 0;
    for (int k = 0; k < j; k++) at += (size_t)(seg[2 * k + 1] - seg[2 * k]) * rank;
    return at;
}
inline void lora_up(const float* h, const float* B, float* y, int N, int out, int rank, int n_seg, const int* seg, int j,
                    int precision) {
    const int o0 = seg[2 * j], width = seg[2 * j + 1] - o0;
    gemm::gemm((Precision)precision, false, true, N, width, rank, h + (size_t)j * rank, n_seg * rank,
               B + lora_b_offset(seg, j, rank), rank, 1.0f, y + o0, out);
}

// The same writing y[:, o0:o1] = h_j B_j^T instead of adding to it.
inline void lora_up_write(const float* h, const float* B, float* y, int N, int out, int rank, int n_seg,
                          const int* seg, int j, int precision) {
    const int o0 = seg[2 * j], width = seg[2 * j + 1] - o0;
    gemm::gemm((Precision)precision, false, true, N, width, rank, h + (size_t)j * rank, n_seg * rank,
               B + lora_b_offset(seg, j, rank), rank, 0.0f, y + o0, out);
}

// The adapter as Clad differentiates it (a Clad build: its pullback is Clad's gradient of this,
// chaining the two products' derivatives below).
inline void lora_adapter(const float* x, const float* A, const float* B, float* h, float* y, int N, int in, int out,
                         int rank, int n_seg, const int* seg, float scale, int precision) {
    lora_down(x, A, h, N, in, n_seg * rank, scale, precision);
    for (int j = 0; j < n_seg; j++) lora_up(h, B, y, N, out, rank, n_seg, seg, j, precision);
}

struct Lora {
    int in, out, rank, n_seg;
    const int* seg;  // n_seg pairs (o0, o1)
    float scale;
    Precision precision = Precision::fp32;
    // Room for a segment's dy rounded to bf16 once (a bf16 pullback reads it in two products,
    // dh and dB, which would each round it): round_values bf16 values, or none (null), and
    // round_small_values for its B and h beside it. The executor lends the frozen base's matrix
    // scratch, idle while the adapters' pullback runs, and the end of the adapters' scratch.
    uint16_t *round_buf = nullptr, *round_small = nullptr;
    size_t round_values = 0, round_small_values = 0;
    // h = scale x A^T as the forward computed it (N x nr(), rows nr() apart), or null: the
    // pullback computes it again.
    const float* h_saved = nullptr;

    int nr() const { return n_seg * rank; }
    // Scratch of the forward (h) and of the pullbacks (h, dh).
    size_t forward_scratch_floats(int N) const { return (size_t)N * nr(); }
    size_t pullback_scratch_floats(int N) const { return 2 * (size_t)N * nr(); }

    // y += scale (x A^T) B^T on every segment.
    void forward(const float* x, const float* A, const float* B, float* y, int N, float* scratch) const {
        lora_adapter(x, A, B, scratch, y, N, in, out, rank, n_seg, seg, scale, (int)precision);
    }
    // forward (write: forward_write) from x already rounded to bf16 (xb, N x in, packed; the
    // layer's product reads it too), A rounded into ab (nr() x in bf16 values).
    void forward_rounded(const uint16_t* xb, const float* A, const float* B, float* y, int N, float* scratch,
                         uint16_t* ab, bool write) const {
        gemm::round_to_bf16(A, in, nr(), in, ab);
        gemm::gemm_bf16(false, true, N, nr(), in, xb, in, ab, in, 0.0f, scratch, nr());
        const size_t n = (size_t)N * nr();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) scratch[i] *= scale;
        for (int j = 0; j < n_seg; j++) {
            if (write)
                lora_up_write(scratch, B, y, N, out, rank, n_seg, seg, j, (int)precision);
            else
                lora_up(scratch, B, y, N, out, rank, n_seg, seg, j, (int)precision);
        }
    }
    // Whether the segments cover y's columns: forward_write then writes all of y.
    bool covers_output() const {
        int at = 0;
        for (int j = 0; j < n_seg; j++) {
            if (seg[2 * j] != at) return false;
            at = seg[2 * j + 1];
        }
        return at == out;
    }
    // y = scale (x A^T) B^T (covers_output()): for a layer whose product then adds onto y.
    void forward_write(const float* x, const float* A, const float* B, float* y, int N, float* scratch) const {
        lora_down(x, A, scratch, N, in, nr(), scale, (int)precision);
        for (int j = 0; j < n_seg; j++) lora_up_write(scratch, B, y, N, out, rank, n_seg, seg, j, (int)precision);
    }

    // From dy (N, out): dA and dB written or added per mode, dx (N, in) added into (or written
    // when !accumulate_dx). h: h_saved where the executor kept it from the forward, else recomputed.
    void pullback(const float* x, const float* A, const float* B, const float* dy, float* dx, float* dA, float* dB,
                  int N, bool accumulate_dx, GradMode mode, float* scratch) const {
        const Precision p = precision;
        const float beta = mode == GradMode::add ? 1.0f : 0.0f;
        const float* h = h_saved ? h_saved : scratch;
        float* dh = scratch + (size_t)N * nr();
        if (!h_saved) lora_down(x, A, scratch, N, in, nr(), scale, (int)p);
        for (int j = 0; j < n_seg; j++) {
            const int o0 = seg[2 * j], width = seg[2 * j + 1] - o0;
            const size_t b = lora_b_offset(seg, j, rank);
            // dy's segment (N x width) with B_j (width x rank) and h_j (N x rank), all rounded
            if (p == Precision::bf16 && round_buf && (size_t)N * width <= round_values &&
                (size_t)(N + width) * rank <= round_small_values) {
                uint16_t *dyb = round_buf, *bb = round_small, *hb = bb + (size_t)width * rank;
                gemm::round_to_bf16(dy + o0, out, N, width, dyb);
                gemm::round_to_bf16(B + b, rank, width, rank, bb);
                gemm::round_to_bf16(h + (size_t)j * rank, nr(), N, rank, hb);
                gemm::gemm_bf16(false, false, N, rank, width, dyb, width, bb, rank, 0.0f, dh + (size_t)j * rank, nr());
                gemm::gemm_bf16(true, false, width, rank, N, dyb, width, hb, rank, beta, dB + b, rank);
                continue;
            }
            gemm::gemm(p, false, false, N, rank, width, dy + o0, out, B + b, rank, 0.0f, dh + (size_t)j * rank, nr());
            gemm::gemm(p, true, false, width, rank, N, dy + o0, out, h + (size_t)j * rank, nr(), beta, dB + b, rank);
        }
        const size_t n = (size_t)N * nr();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) dh[i] *= scale;
        gemm::gemm(p, true, false, nr(), in, N, dh, nr(), x, in, beta, dA, in);
        gemm::gemm(p, false, false, N, in, nr(), dh, nr(), A, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
    }

    // Clad's gradient of lora_adapter (a Clad build; defined below). Same contract as pullback.
    void pullback_clad(const float* x, const float* A, const float* B, const float* dy, float* dx, float* dA,
                       float* dB, int N, bool accumulate_dx, GradMode mode, float* scratch) const;
};

// Dropout on the adapter's input: x_d = x m / (1 - p), m[i] = 0 with probability p, drawn from
// a hash of (seed, i), so the pullback redraws the same mask instead of keeping it.
inline bool lora_keep(uint64_t seed, size_t i, float p) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0) >= p;
}
inline void lora_dropout(uint64_t seed, float p, const float* x, float* xd, size_t n) {
    const float keep_scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) xd[i] = lora_keep(seed, i, p) ? x[i] * keep_scale : 0.0f;
}
// dx += the adjoint of x_d through the same mask.
inline void lora_dropout_pullback(uint64_t seed, float p, const float* dxd, float* dx, size_t n) {
    const float keep_scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        if (lora_keep(seed, i, p)) dx[i] += dxd[i] * keep_scale;
}

// The registry entry (native/blocks/registry.hpp).
using LoraPullback = void (*)(const Lora& l, const float* x, const float* A, const float* B, const float* dy,
                              float* dx, float* dA, float* dB, int N, bool accumulate_dx, GradMode mode,
                              float* scratch);
void lora_pullback_clad(const Lora& l, const float* x, const float* A, const float* B, const float* dy, float* dx,
                        float* dA, float* dB, int N, bool accumulate_dx, GradMode mode, float* scratch);
inline const FixedBlock<LoraPullback> lora_block{
    "lora",
    [](const Lora& l, const float* x, const float* A, const float* B, const float* dy, float* dx, float* dA,
       float* dB, int N, bool accumulate_dx, GradMode mode, float* scratch) {
        l.pullback(x, A, B, dy, dx, dA, dB, N, accumulate_dx, mode, scratch);
    },
    ZOO_CLAD_FN(lora_pullback_clad),
    /*in_step=*/false,  // only in a LoRA run's step
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace clad::custom_derivatives::zoo {
// The replay before the reverse sweep recomputes h (the pullback's scratch, not kept).
inline void lora_down_reverse_forw(const float* x, const float* A, float* h, int N, int in, int nr, float scale,
                                   int precision, const float*, const float*, float*, int, int, int, float, int,
                                   clad::pullback_state<>&) {
    ::zoo::lora_down(x, A, h, N, in, nr, scale, precision);
}
inline void lora_down_pullback(const float* x, const float* A, float* h, int N, int in, int nr, float scale,
                               int precision, float* d_x, float* d_A, float* d_h, int*, int*, int*, float*, int*,
                               clad::pullback_state<>) {
    const ::zoo::Precision p = (::zoo::Precision)precision;
    const size_t n = (size_t)N * nr;
    for (size_t i = 0; i < n; i++) d_h[i] *= scale;
    ::zoo::gemm::gemm(p, true, false, nr, in, N, d_h, nr, x, in, 1.0f, d_A, in);
    ::zoo::gemm::gemm(p, false, false, N, in, nr, d_h, nr, A, in, 1.0f, d_x, in);
}
// y's value is never read in the reverse sweep: the replay of y += h B^T does nothing.
inline void lora_up_reverse_forw(const float*, const float*, float*, int, int, int, int, const int*, int, int,
                                 const float*, const float*, float*, int, int, int, int, const int*, int, int,
                                 clad::pullback_state<>&) {}
inline void lora_up_pullback(const float* h, const float* B, float* y, int N, int out, int rank, int n_seg,
                             const int* seg, int j, int precision, float* d_h, float* d_B, float* d_y, int*, int*,
                             int*, int*, int*, int*, clad::pullback_state<>) {
    const ::zoo::Precision p = (::zoo::Precision)precision;
    const int o0 = seg[2 * j], width = seg[2 * j + 1] - o0, nr = n_seg * rank;
    const size_t b = ::zoo::lora_b_offset(seg, j, rank);
    ::zoo::gemm::gemm(p, false, false, N, rank, width, d_y + o0, out, B + b, rank, 1.0f, d_h + (size_t)j * rank, nr);
    ::zoo::gemm::gemm(p, true, false, width, rank, N, d_y + o0, out, h + (size_t)j * rank, nr, 1.0f, d_B + b, rank);
}
}  // namespace clad::custom_derivatives::zoo

void zoo::Lora::pullback_clad(const float* x, const float* A, const float* B, const float* dy, float* dx, float* dA,
                              float* dB, int N, bool accumulate_dx, GradMode mode, float* scratch) const {
    // The gradient adds into every adjoint: clear the ones this pullback writes.
    if (!accumulate_dx) std::memset(dx, 0, sizeof(float) * N * in);
    if (mode == GradMode::write) {
        std::memset(dA, 0, sizeof(float) * nr() * in);
        std::memset(dB, 0, sizeof(float) * lora_b_offset(seg, n_seg, rank));
    }
    float *h = scratch, *d_h = scratch + (size_t)N * nr();
    std::memset(d_h, 0, sizeof(float) * N * nr());
    // y += ... passes its adjoint through unchanged: the gradient reads dy and leaves it.
    float* d_y = const_cast<float*>(dy);
    clad::gradient(lora_adapter, "x, A, B, h, y")
        .execute(x, A, B, h, nullptr, N, in, out, rank, n_seg, seg, scale, (int)precision, dx, dA, dB, d_h, d_y);
}

void zoo::lora_pullback_clad(const Lora& l, const float* x, const float* A, const float* B, const float* dy,
                             float* dx, float* dA, float* dB, int N, bool accumulate_dx, GradMode mode,
                             float* scratch) {
    l.pullback_clad(x, A, B, dy, dx, dA, dB, N, accumulate_dx, mode, scratch);
}
#endif
