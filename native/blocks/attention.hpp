// Causal scaled dot-product attention with grouped-query heads: query head h reads key/value
// head h / (n_head / n_kv_head). Works on the fused qkv rows [q (nh*hd) | k (nkv*hd) | v (nkv*hd)].
#pragma once
#include <cmath>
#include <cstddef>
#include <cstring>

#include <omp.h>

#include "../clad_backend.hpp"
#include "../fastmath.hpp"

namespace zoo {

// The two inner loops as functions of their own. Clad differentiates each with one flat,
// countable loop; written nested in the row kernel, the inner trip counts go on a tape and
// the reverse loops do not vectorize (2x slower pullback, docs/clad.md).
inline float vec_dot(const float* a, const float* b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void vec_axpy(float a, const float* x, float* y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

// One query row against keys 0..n_keys-1 (rows kv_stride apart). Writes the softmax
// probabilities p (n_keys) and the output o (hd). Written for Clad: each p[j] is written
// twice (score, then probability: one taped value per key), the scale sits inside the
// exponent and the normalization is a subtracted log-sum, so no other value needs a tape.
inline void attention_forward_row(const float* q, const float* k, const float* v, float* p,
                                  float* o, int kv_stride, int n_keys, int hd, float scale) {
    for (int j = 0; j < n_keys; j++) p[j] = vec_dot(q, k + (size_t)j * kv_stride, hd);
    float mx = row_max(p, n_keys);
    float sum = 0.0f;
    for (int j = 0; j < n_keys; j++) sum += fast_exp(scale * (p[j] - mx));
    float lse = std::log(sum);
    for (int j = 0; j < n_keys; j++) p[j] = fast_exp(scale * (p[j] - mx) - lse);
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int j = 0; j < n_keys; j++) vec_axpy(p[j], v + (size_t)j * kv_stride, o, hd);
}

struct Attention {
    int n_head, n_kv_head, head_dim;

    int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim; }

    // Training/prefill over whole sequences. qkv: (B*T, qkv_dim) with RoPE already applied;
    // probs: (B, n_head, T, T) saved for the pullback (only the causal part is written);
    // out: (B*T, n_head*hd).
    void forward(const float* qkv, float* probs, float* out, int B, int T) const {
        const int stride = qkv_dim(), group = n_head / n_kv_head;
        const float scale = 1.0f / std::sqrt((float)head_dim);
#pragma omp parallel for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < n_head; h++)
                for (int t = 0; t < T; t++) {
                    const int g = h / group;
                    const float* base = qkv + (size_t)b * T * stride;
                    attention_forward_row(
                        base + (size_t)t * stride + h * head_dim,
                        base + (n_head + g) * head_dim, base + (n_head + n_kv_head + g) * head_dim,
                        probs + (((size_t)b * n_head + h) * T + t) * T,
                        out + ((size_t)b * T + t) * n_head * head_dim + h * head_dim, stride,
                        t + 1, head_dim, scale);
                }
    }

    // Queries at positions pos0..pos0+Tq-1 against a KV cache laid out (B, n_kv_head, max_len,
    // hd). scratch: (B, n_head, Tq, pos0+Tq) probabilities, discarded.
    void forward_cached(const float* qkv, const float* k_cache, const float* v_cache,
                        float* scratch, float* out, int B, int Tq, int pos0, int max_len) const {
        const int stride = qkv_dim(), group = n_head / n_kv_head, Tk = pos0 + Tq;
        const float scale = 1.0f / std::sqrt((float)head_dim);
#pragma omp parallel for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < n_head; h++)
                for (int t = 0; t < Tq; t++) {
                    const size_t cache_at = ((size_t)b * n_kv_head + h / group) * max_len * head_dim;
                    attention_forward_row(
                        qkv + ((size_t)b * Tq + t) * stride + h * head_dim, k_cache + cache_at,
                        v_cache + cache_at, scratch + (((size_t)b * n_head + h) * Tq + t) * Tk,
                        out + ((size_t)b * Tq + t) * n_head * head_dim + h * head_dim, head_dim,
                        pos0 + t + 1, head_dim, scale);
                }
    }

    // Writes d_qkv (all three parts). probs is overwritten with the softmax adjoint.
    // One task per (batch, kv head): it owns that head's dk, dv, so no two threads write
    // the same element. scratch: one row of T floats per thread.
    void pullback(const float* qkv, float* probs, const float* d_out, float* d_qkv,
                  float* scratch, int B, int T) const;

    // The Clad backend's pullback: Clad's gradient of attention_forward_row, one task per
    // (batch, kv head) as in pullback (defined below, compiled only into a Clad build). It
    // replays each row's softmax instead of reading probs. scratch: clad_scratch_floats().
    size_t clad_row_floats(int T) const { return ((size_t)2 * T + 2 * head_dim + 15) / 16 * 16; }
    size_t clad_scratch_floats(int threads, int T) const { return (size_t)threads * clad_row_floats(T); }
    void pullback_clad(const float* qkv, const float* d_out, float* d_qkv, float* scratch, int B,
                       int T) const;
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// Per thread: [p (T) | dp (T) | o (hd) | seed (hd)].
void zoo::Attention::pullback_clad(const float* qkv, const float* d_out, float* d_qkv, float* scratch,
                                   int B, int T) const {
    const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim;
    const float scale = 1.0f / std::sqrt((float)hd);
#pragma omp parallel
    {
        auto grad = clad::gradient(attention_forward_row, "q, k, v, p, o");
        float* p = scratch + omp_get_thread_num() * clad_row_floats(T);
        float *dp = p + T, *o = p + 2 * T, *seed = o + hd;
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int g = 0; g < n_kv_head; g++) {
                const float* base = qkv + (size_t)b * T * stride;
                float* dbase = d_qkv + (size_t)b * T * stride;
                const float* k = base + (n_head + g) * hd;
                const float* v = base + (n_head + n_kv_head + g) * hd;
                float* dk = dbase + (n_head + g) * hd;
                float* dv = dbase + (n_head + n_kv_head + g) * hd;
                // The gradient adds into dq, dk, dv; this pullback writes them.
                for (int t = 0; t < T; t++) {
                    float* row = dbase + (size_t)t * stride;
                    for (int i = 0; i < group * hd; i++) row[g * group * hd + i] = 0.0f;
                    for (int i = 0; i < hd; i++) dk[(size_t)t * stride + i] = dv[(size_t)t * stride + i] = 0.0f;
                }
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int t = 0; t < T; t++) {
                        const float* dout = d_out + ((size_t)b * T + t) * n_head * hd + h * hd;
                        for (int i = 0; i < hd; i++) seed[i] = dout[i];  // consumed
                        for (int j = 0; j <= t; j++) dp[j] = 0.0f;
                        grad.execute(base + (size_t)t * stride + h * hd, k, v, p, o, stride, t + 1, hd,
                                     scale, dbase + (size_t)t * stride + h * hd, dk, dv, dp, seed);
                    }
            }
    }
}
#endif

inline void zoo::Attention::pullback(const float* qkv, float* probs, const float* d_out,
                                     float* d_qkv, float* scratch, int B, int T) const {
    const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim;
    const float scale = 1.0f / std::sqrt((float)hd);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < n_kv_head; g++) {
            float* dp = scratch + (size_t)omp_get_thread_num() * T;
            const float* base = qkv + (size_t)b * T * stride;
            float* dbase = d_qkv + (size_t)b * T * stride;
            const float* k = base + (n_head + g) * hd;
            const float* v = base + (n_head + n_kv_head + g) * hd;
            float* dk = dbase + (n_head + g) * hd;
            float* dv = dbase + (n_head + n_kv_head + g) * hd;
            for (int t = 0; t < T; t++) {
                std::memset(dk + (size_t)t * stride, 0, sizeof(float) * hd);
                std::memset(dv + (size_t)t * stride, 0, sizeof(float) * hd);
            }
            for (int h = g * group; h < (g + 1) * group; h++)
                for (int t = 0; t < T; t++) {
                    const float* q = base + (size_t)t * stride + h * hd;
                    float* dq = dbase + (size_t)t * stride + h * hd;
                    const float* dout = d_out + ((size_t)b * T + t) * n_head * hd + h * hd;
                    float* p = probs + (((size_t)b * n_head + h) * T + t) * T;
                    float dot = 0.0f;
                    for (int j = 0; j <= t; j++) {
                        const float* vj = v + (size_t)j * stride;
                        float* dvj = dv + (size_t)j * stride;
                        float s = 0.0f;
                        for (int d = 0; d < hd; d++) {
                            s += dout[d] * vj[d];
                            dvj[d] += p[j] * dout[d];
                        }
                        dp[j] = s;
                        dot += p[j] * s;
                    }
                    for (int j = 0; j <= t; j++) p[j] = p[j] * (dp[j] - dot) * scale;
                    for (int d = 0; d < hd; d++) dq[d] = 0.0f;
                    for (int j = 0; j <= t; j++) {
                        const float* kj = k + (size_t)j * stride;
                        float* dkj = dk + (size_t)j * stride;
                        for (int d = 0; d < hd; d++) {
                            dq[d] += p[j] * kj[d];
                            dkj[d] += p[j] * q[d];
                        }
                    }
                }
        }
}
