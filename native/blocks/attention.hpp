// Causal scaled dot-product attention with grouped-query heads: query head h reads key/value
// head h / (n_head / n_kv_head). Works on the fused qkv rows [q (nh*hd) | k (nkv*hd) | v (nkv*hd)].
#pragma once
#include <cmath>
#include <cstddef>
#include <cstring>

#include <omp.h>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// Dot product and a*x + y: the inner loops of the row kernel below.
inline float vec_dot(const float* a, const float* b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void vec_axpy(float a, const float* x, float* y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

// One query row against keys 0..n_keys-1 (rows kv_stride apart), and n_keys2 more at k2, v2
// (a ring cache's keys wrap around its end): generation with a KV cache. Every key is visible,
// so their order does not matter. Writes the softmax probabilities p (n_keys + n_keys2) and the
// output o (hd).
inline void attention_forward_row(const float* q, const float* k, const float* v, float* p,
                                  float* o, int kv_stride, int n_keys, int hd, float scale, float softcap = 0.0f,
                                  const float* k2 = nullptr, const float* v2 = nullptr, int n_keys2 = 0) {
    const int n_first = n_keys;
    for (int j = 0; j < n_first; j++) p[j] = vec_dot(q, k + (size_t)j * kv_stride, hd);
    for (int j = 0; j < n_keys2; j++) p[n_first + j] = vec_dot(q, k2 + (size_t)j * kv_stride, hd);
    n_keys += n_keys2;
    if (softcap > 0.0f) {  // the capped scores, then a softmax at scale 1
        for (int j = 0; j < n_keys; j++) p[j] = softcap * fast_tanh(scale * p[j] / softcap);
        scale = 1.0f;
    }
    float mx = row_max(p, n_keys);
    float sum = 0.0f;
    for (int j = 0; j < n_keys; j++) sum += fast_exp(scale * (p[j] - mx));
    float lse = std::log(sum);
    for (int j = 0; j < n_keys; j++) p[j] = fast_exp(scale * (p[j] - mx) - lse);
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int j = 0; j < n_first; j++) vec_axpy(p[j], v + (size_t)j * kv_stride, o, hd);
    for (int j = 0; j < n_keys2; j++) vec_axpy(p[n_first + j], v2 + (size_t)j * kv_stride, o, hd);
}

// The training kernels below work on blocks of query rows with register tiles: a GCC/Clang
// vector type as wide as one of the CPU's vector registers. Each key or value row loaded feeds
// one fused multiply-add per query row of the block, where the row kernel above does one
// horizontal reduction per key: the GPT-2 step's attention 1.6x faster at T=64 and 2.6x at
// T=256, rebuilding the probabilities included (docs/benchmarks.md). A kernel holds at most
// kTileRows rows' tiles at a time, so that its accumulators fit the register file: AVX-512 has
// 32 registers, AVX2 and SSE 16. (Tiles of 16 floats on AVX2 took two registers each, and the
// 8 rows' 32 accumulators went through the stack: the GPT-2 step's attention 30x slower on a
// Zen 3 than on a Zen 5 forced to AVX2.)
#if defined(__AVX512F__)
#define ZOO_TILE_LANES 16
constexpr int kTileRows = 8;
#elif defined(__AVX__)
#define ZOO_TILE_LANES 8
constexpr int kTileRows = 4;
#else  // SSE, NEON and scalar builds: 128-bit vectors
#define ZOO_TILE_LANES 4
constexpr int kTileRows = 4;
#endif
constexpr int kTileLanes = ZOO_TILE_LANES;
typedef float f32xL __attribute__((vector_size(4 * ZOO_TILE_LANES), aligned(4), may_alias));
#undef ZOO_TILE_LANES
inline f32xL load_tile(const float* p) { return *reinterpret_cast<const f32xL*>(p); }
inline void store_tile(float* p, f32xL v) { *reinterpret_cast<f32xL*>(p) = v; }
// The rows a kernel of R rows holds at once; R is 1 or a multiple of kTileRows.
template <int R>
constexpr int tile_group() {
    static_assert(R < kTileRows || R % kTileRows == 0, "a block's rows split into whole groups");
    return R < kTileRows ? R : kTileRows;
}

// The kernels take two tiles per pass where they can: each broadcast row element then feeds
// two multiply-adds, which halves the loads per multiply-add (loads, not arithmetic, bound
// these small products). Column tiles are the outer loop and row groups the inner one, so a
// tile's column stays in L1 for every group. Each output element's terms are written in the
// same order at every width and grouping; -fassociative-math lets the compiler regroup them,
// so the last bits may differ between widths.

// s[r][0..n16) = a[r] . bt[:, j]: R rows of a (lda apart, kdim long) against the columns of
// bt, kdim rows of ldb floats (keys transposed, so a tile of keys loads as one vector).
// n16 % 16 == 0. Add: s += instead of s = (a custom derivative adds into its adjoints).
template <int R, bool Add = false>
inline void tile_rows_dot_cols(const float* a, size_t lda, const float* bt, int ldb, int kdim, int n16,
                               float* s, int lds) {
    constexpr int G = tile_group<R>(), L = kTileLanes;
    int j = 0;
    for (; j + 2 * L <= n16; j += 2 * L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL acc0[G] = {}, acc1[G] = {};
            for (int k = 0; k < kdim; k++) {
                const f32xL b0 = load_tile(bt + (size_t)k * ldb + j), b1 = load_tile(bt + (size_t)k * ldb + j + L);
                for (int r = 0; r < G; r++) {
                    const float ar = a[(r0 + r) * lda + k];
                    acc0[r] += b0 * ar;
                    acc1[r] += b1 * ar;
                }
            }
            for (int r = 0; r < G; r++) {
                float* sr = s + (size_t)(r0 + r) * lds + j;
                store_tile(sr, Add ? load_tile(sr) + acc0[r] : acc0[r]);
                store_tile(sr + L, Add ? load_tile(sr + L) + acc1[r] : acc1[r]);
            }
        }
    for (; j < n16; j += L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL acc[G] = {};
            for (int k = 0; k < kdim; k++) {
                const f32xL b = load_tile(bt + (size_t)k * ldb + j);
                for (int r = 0; r < G; r++) acc[r] += b * a[(r0 + r) * lda + k];
            }
            for (int r = 0; r < G; r++) {
                float* sr = s + (size_t)(r0 + r) * lds + j;
                store_tile(sr, Add ? load_tile(sr) + acc[r] : acc[r]);
            }
        }
}

// c[r][0..hd) = sum over j < n of p[r][j] m[j]: R rows of weights times rows of m (ldm apart).
// Add: c += instead of c =.
template <int R, bool Add = false>
inline void tile_weighted_rows(const float* p, int ldp, const float* m, size_t ldm, int n, int hd,
                               float* c, size_t ldc) {
    constexpr int G = tile_group<R>(), L = kTileLanes;
    int d0 = 0;
    for (; d0 + 2 * L <= hd; d0 += 2 * L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL acc0[G] = {}, acc1[G] = {};
            for (int j = 0; j < n; j++) {
                const f32xL m0 = load_tile(m + j * ldm + d0), m1 = load_tile(m + j * ldm + d0 + L);
                for (int r = 0; r < G; r++) {
                    const float pr = p[(r0 + r) * ldp + j];
                    acc0[r] += m0 * pr;
                    acc1[r] += m1 * pr;
                }
            }
            for (int r = 0; r < G; r++) {
                float* cr = c + (r0 + r) * ldc + d0;
                store_tile(cr, Add ? load_tile(cr) + acc0[r] : acc0[r]);
                store_tile(cr + L, Add ? load_tile(cr + L) + acc1[r] : acc1[r]);
            }
        }
    for (; d0 + L <= hd; d0 += L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL acc[G] = {};
            for (int j = 0; j < n; j++) {
                const f32xL mj = load_tile(m + j * ldm + d0);
                for (int r = 0; r < G; r++) acc[r] += mj * p[(r0 + r) * ldp + j];
            }
            for (int r = 0; r < G; r++) {
                float* cr = c + (r0 + r) * ldc + d0;
                store_tile(cr, Add ? load_tile(cr) + acc[r] : acc[r]);
            }
        }
    for (; d0 < hd; d0++)  // head_dim not a multiple of the tile
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int j = 0; j < n; j++) s += p[r * ldp + j] * m[j * ldm + d0];
            c[r * ldc + d0] = Add ? c[r * ldc + d0] + s : s;
        }
}

// m[j][0..hd) += sum over r of p[r][j] x[r], j < n: the transpose of tile_weighted_rows,
// accumulating (x rows ldx apart, m rows ldm apart).
template <int R>
inline void tile_add_weighted_cols(const float* p, int ldp, const float* x, size_t ldx, int n, int hd,
                                   float* m, size_t ldm) {
    constexpr int G = tile_group<R>(), L = kTileLanes;
    int d0 = 0;
    for (; d0 + 2 * L <= hd; d0 += 2 * L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL x0[G], x1[G];
            for (int r = 0; r < G; r++) {
                x0[r] = load_tile(x + (r0 + r) * ldx + d0);
                x1[r] = load_tile(x + (r0 + r) * ldx + d0 + L);
            }
            for (int j = 0; j < n; j++) {
                f32xL acc0 = load_tile(m + j * ldm + d0), acc1 = load_tile(m + j * ldm + d0 + L);
                for (int r = 0; r < G; r++) {
                    const float pr = p[(r0 + r) * ldp + j];
                    acc0 += x0[r] * pr;
                    acc1 += x1[r] * pr;
                }
                store_tile(m + j * ldm + d0, acc0);
                store_tile(m + j * ldm + d0 + L, acc1);
            }
        }
    for (; d0 + L <= hd; d0 += L)
        for (int r0 = 0; r0 < R; r0 += G) {
            f32xL xr[G];
            for (int r = 0; r < G; r++) xr[r] = load_tile(x + (r0 + r) * ldx + d0);
            for (int j = 0; j < n; j++) {
                f32xL acc = load_tile(m + j * ldm + d0);
                for (int r = 0; r < G; r++) acc += xr[r] * p[(r0 + r) * ldp + j];
                store_tile(m + j * ldm + d0, acc);
            }
        }
    for (; d0 < hd; d0++)
        for (int j = 0; j < n; j++) {
            float s = m[j * ldm + d0];
            for (int r = 0; r < R; r++) s += p[r * ldp + j] * x[r * ldx + d0];
            m[j * ldm + d0] = s;
        }
}

// rows (ld apart) of hd floats -> hd rows of ldt floats; columns n..ldt-1 zeroed. Sixteen
// rows at a time: their lines stay in L1 while every column is read from them, where a
// column of all n rows at once (64 KB at T=256) missed L1 on each read (2.2x slower).
inline void transpose_rows(const float* x, size_t ld, int n, int hd, float* xt, int ldt) {
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16)
        for (int d = 0; d < hd; d++) {
            float* row = xt + (size_t)d * ldt + j0;
            const float* col = x + (size_t)j0 * ld + d;
            for (int j = 0; j < 16; j++) row[j] = col[j * ld];
        }
    for (int d = 0; d < hd; d++) {
        float* row = xt + (size_t)d * ldt;
        for (int j = j0; j < n; j++) row[j] = x[j * ld + d];
        for (int j = n; j < ldt; j++) row[j] = 0.0f;
    }
}

// --- What the Clad backend differentiates: a block of query rows of one head ----------------
// attention_forward_rows: scores, softmax, weighted values. Clad writes the softmax's
// derivative; the two products are functions of their own whose derivatives (products too)
// are the tiled kernels above, given to Clad as custom derivatives as linear.hpp gives it the
// GEMM's. Clad cannot tile: differentiated as scalar loops (one dot product per key, the row
// kernel above) the pullback cost 6-7x the hand-written one (docs/clad.md).
constexpr int kAttentionBlockRows = 8;  // query rows per tile
inline int attention_padded(int n) { return (n + 15) / 16 * 16; }

// s[r][0..padded(n)) = scale q_r . k_j: R query rows (stride apart) against keys transposed
// (kt, hd rows of Tp floats); k (rows stride apart) is what the derivative reads. The scale is
// applied here, not in the softmax: a float argument of the softmax would get an adjoint that
// Clad accumulates through a pointer in every iteration, which keeps its loops scalar.
inline void attention_scores(const float* q, const float* k, const float* kt, float* s, int R, int n, int hd,
                             int stride, int Tp, float scale) {
    const int n16 = attention_padded(n);
    if (R == kAttentionBlockRows)
        tile_rows_dot_cols<kAttentionBlockRows>(q, stride, kt, Tp, hd, n16, s, Tp);
    else
        for (int r = 0; r < R; r++)
            tile_rows_dot_cols<1>(q + (size_t)r * stride, stride, kt, Tp, hd, n16, s + (size_t)r * Tp, Tp);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n16; j++) s[(size_t)r * Tp + j] *= scale;
}

// o[r] += sum over j < n of p[r][j] v_j: R rows of probabilities (Tp apart) times value rows
// (stride apart), into output rows ldo apart. vt (values transposed) is what the derivative reads.
inline void attention_weighted_values(const float* p, const float* v, const float* vt, float* o, int R, int n,
                                      int hd, int stride, int ldo, int Tp) {
    if (R == kAttentionBlockRows)
        tile_weighted_rows<kAttentionBlockRows, true>(p, Tp, v, stride, n, hd, o, ldo);
    else
        for (int r = 0; r < R; r++)
            tile_weighted_rows<1, true>(p + (size_t)r * Tp, Tp, v, stride, n, hd, o + (size_t)r * ldo, ldo);
}

// Soft-capping (Gemma 2): each row's scaled scores of keys 0..t0+r -> cap tanh(s / cap), in
// place (cap 0: none). Its derivative, 1 - (capped / cap)^2, reads the capped values (Clad's
// custom derivative below): nothing is taped.
inline void attention_cap_scores(float* s, int R, int t0, int Tp, float cap) {
    if (cap <= 0.0f) return;
    for (int r = 0; r < R; r++)
        for (int j = 0; j <= t0 + r; j++) s[(size_t)r * Tp + j] = cap * std::tanh(s[(size_t)r * Tp + j] / cap);
}

// The softmax of row r of the block (rows Tp apart) over keys first..keys-1 without the hidden
// span [lo, hi), given its exponentials e there: p = e / sum e, zero elsewhere up to n16
// (block.hpp's visible_keys). A helper for the row's loops (see
// attention_forward_rows); flat loops, each element written once: Clad tapes nothing. The row
// is an argument, not an offset of e and p: Clad (master 4b2c0eef) drops the reverse loop's
// r-- when r appears only in a pointer offset.
inline void attention_normalize_row(const float* e, float* p, int r, int Tp, int first, int lo, int hi, int keys,
                                    int n16) {
    const size_t row = (size_t)r * Tp;
    float sum = 0.0f;
    for (int j = first; j < lo; j++) sum += e[row + j];
    for (int j = hi; j < keys; j++) sum += e[row + j];
    float inv = 1.0f / sum;
    for (int j = first; j < lo; j++) p[row + j] = e[row + j] * inv;
    for (int j = hi; j < keys; j++) p[row + j] = e[row + j] * inv;
    for (int j = 0; j < first; j++) p[row + j] = 0.0f;
    for (int j = lo; j < hi; j++) p[row + j] = 0.0f;
    for (int j = keys; j < n16; j++) p[row + j] = 0.0f;
}

// Query rows t0..t0+R-1 of one head against keys 0..t0+R-1: row r attends to keys
// first[r]..t0+r (its packed example and window) except the hidden span [lo[r], hi[r]), the scaled
// scores soft-capped where softcap > 0. Adds the output rows into o (the caller zeroes o): an add
// passes the adjoint through, so the gradient reads dL/do where it lies. s, e, p: R x Tp each.
// The softmax is arranged for what Clad's gradient computes (docs/clad.md): the exponentials
// e = exp(s - max) are an array, computed in this function's own loop, so Clad's forward sweep
// is the only place they are computed (a helper's pullback would replay them) and exp_row's
// derivative reads them; the max shift has a zero derivative (softmax_shift), so nothing
// scans the row for it again; Clad keeps each row's max on a tape (R floats, in the tape's
// own buffer: no allocation). p then comes from e in a helper (no exponential to replay), in
// a loop of its own: one that read e in the loop that writes it would have Clad save and
// restore e element by element (clad::restore_tracker). One exponential per score, as in the
// hand-written pullback; p = exp(s - max - lse) in one helper cost six exponentials per score
// and four scans of the row (the max's derivative looked for where it is).
inline void attention_forward_rows(const float* q, const float* k, const float* kt, const float* v,
                                   const float* vt, float* s, float* e, float* p, float* o, const int* first,
                                   const int* lo, const int* hi, int t0, int R, int hd, int stride, int ldo, int Tp,
                                   float scale, float softcap) {
    attention_scores(q, k, kt, s, R, t0 + R, hd, stride, Tp, scale);
    attention_cap_scores(s, R, t0, Tp, softcap);
    for (int r = 0; r < R; r++) {  // no local for the row's offset: Clad would tape it too
        float mx = softmax_shift_skipping(s + (size_t)r * Tp, first[r], lo[r], hi[r], t0 + r + 1);
        exp_row(s + (size_t)r * Tp + first[r], mx, e + (size_t)r * Tp + first[r], lo[r] - first[r]);
        exp_row(s + (size_t)r * Tp + hi[r], mx, e + (size_t)r * Tp + hi[r], t0 + r + 1 - hi[r]);
    }
    for (int r = 0; r < R; r++)
        attention_normalize_row(e, p, r, Tp, first[r], lo[r], hi[r], t0 + r + 1, attention_padded(t0 + R));
    attention_weighted_values(p, v, vt, o, R, t0 + R, hd, stride, ldo, Tp);
}

// Generation: rows row..row+len-1 of a call hold positions start..start+len-1 of one sequence,
// the KV cache's slot (Attention::forward_cached).
struct CacheRun {
    int slot, start, len, row;
};

struct Attention {
    int n_head, n_kv_head, head_dim;
    int window = 0;      // a sliding window: each query sees its last `window` keys (0: all before it)
    float scale = 0.0f;  // the scores' scale; 0: 1/sqrt(head_dim)
    float softcap = 0.0f;  // scaled scores s -> softcap tanh(s / softcap) before the softmax (Gemma 2); 0: none
    static constexpr int kBlockRows = kAttentionBlockRows;

    float softmax_scale() const { return scale != 0.0f ? scale : 1.0f / std::sqrt((float)head_dim); }
    // The keys row t of a sequence sees (block.hpp), within the window.
    VisibleKeys visible(const int32_t* pos, const int32_t* hid, int t) const {
        return windowed_keys(visible_keys(pos, hid, t), t, window);
    }
    // Generation: the first key a query at position p sees.
    int first_key(int p) const { return window > 0 && p + 1 > window ? p + 1 - window : 0; }

    int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim; }
    static int padded(int T) { return (T + 15) / 16 * 16; }
    // Per thread: keys and values transposed (hd x padded T each), and two blocks of rows.
    size_t thread_scratch_floats(int T) const { return (2 * (size_t)head_dim + 2 * kBlockRows) * padded(T); }
    size_t scratch_floats(int threads, int T) const { return (size_t)threads * thread_scratch_floats(T); }

    // Training/prefill over whole sequences. qkv: (B*T, qkv_dim) with RoPE already applied;
    // out: (B*T, n_head*hd). lse: (B, n_head, T), each row's log-sum-exp of its scaled
    // scores, all the pullback needs to rebuild the probabilities: O(T) memory per head where
    // the probabilities would take O(T^2). positions (B*T, may be null) and hidden (B*T pairs,
    // may be null): the keys each row sees (visible_keys, block.hpp), its own packed example less
    // a hidden span. scratch: scratch_floats(threads, T).
    void forward(const float* qkv, const int32_t* positions, const int32_t* hidden, float* lse, float* out,
                 float* scratch, int B, int T) const {
        const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim, Tp = padded(T);
        const float scale = softmax_scale();
#pragma omp parallel for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < n_head; h++) {
                float* kt = scratch + (size_t)omp_get_thread_num() * thread_scratch_floats(T);
                float* block = kt + 2 * (size_t)hd * Tp;
                const float* base = qkv + (size_t)b * T * stride;
                const int g = h / group;
                transpose_rows(base + (n_head + g) * hd, stride, T, hd, kt, Tp);
                const float* v = base + (n_head + n_kv_head + g) * hd;
                float* l = lse + ((size_t)b * n_head + h) * T;
                float* o = out + (size_t)b * T * n_head * hd + h * hd;
                const int32_t* pos = positions ? positions + (size_t)b * T : nullptr;
                const int32_t* hid = hidden ? hidden + 2 * (size_t)b * T : nullptr;
                int t0 = 0;
                for (; t0 + kBlockRows <= T; t0 += kBlockRows)
                    forward_rows<kBlockRows>(base + h * hd, stride, kt, v, pos, hid, l, o, block, t0, T, scale);
                for (; t0 < T; t0++)
                    forward_rows<1>(base + h * hd, stride, kt, v, pos, hid, l, o, block, t0, T, scale);
            }
    }

    // Query rows t0..t0+R-1 of one head: scores against keys 0..t0+R-1, causal softmax over
    // each row's keys (first..t less its hidden span) into block (R x padded T, zero outside
    // them), the rows' log-sum-exp into lse, output rows into o. pos, hid: this sequence's
    // positions and hidden spans (or null).
    template <int R>
    void forward_rows(const float* q, int stride, const float* kt, const float* v, const int32_t* pos,
                      const int32_t* hid, float* lse, float* o, float* block, int t0, int T, float scale) const {
        const int hd = head_dim, Tp = padded(T), n = t0 + R;
        tile_rows_dot_cols<R>(q + (size_t)t0 * stride, stride, kt, Tp, hd, padded(n), block, Tp);
        for (int r = 0; r < R; r++) {
            float* s = block + (size_t)r * Tp;
            const int keys = t0 + r + 1;
            const VisibleKeys vis = visible(pos, hid, t0 + r);
            // The row's keys in two runs: first..lo-1 and hi..t (one run where nothing is hidden).
            const int run_begin[2] = {vis.first, vis.hi}, run_end[2] = {vis.lo, keys};
            float sc = scale;  // with a soft cap: the capped scores, then a softmax at scale 1
            if (softcap > 0.0f) {
                for (int run = 0; run < 2; run++)
                    for (int j = run_begin[run]; j < run_end[run]; j++)
                        s[j] = softcap * fast_tanh(scale * s[j] / softcap);
                sc = 1.0f;
            }
            const float mx = softmax_shift_skipping(s, vis.first, vis.lo, vis.hi, keys);
            float sum = 0.0f;
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) {
                    s[j] = fast_exp(sc * (s[j] - mx));
                    sum += s[j];
                }
            const float inv = 1.0f / sum;
            lse[t0 + r] = sc * mx + std::log(sum);
            for (int j = 0; j < vis.first; j++) s[j] = 0.0f;
            for (int j = vis.lo; j < vis.hi; j++) s[j] = 0.0f;
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) s[j] *= inv;
            for (int j = keys; j < n; j++) s[j] = 0.0f;
        }
        tile_weighted_rows<R>(block, Tp, v, stride, n, hd, o + (size_t)t0 * n_head * hd, (size_t)n_head * hd);
    }

    // Generation against a KV cache laid out (slots, n_kv_head, cap, hd): each run's rows of qkv
    // (RoPE applied) put their keys and values into its slot's cache, position p at row p % cap,
    // then their queries attend to the slot's keys up to their own position. cap is the cache
    // length (every position), or for a layer with a window a ring of at least window - 1 +
    // the rows of a call (the keys any of its rows sees stay in it). A run of at least
    // kBlockRows rows (a prompt) takes the training kernels' tiles against the keys it sees,
    // gathered in position order and transposed; shorter ones (new tokens) one row at a time.
    // out: (rows, n_head*hd). scratch: cached_scratch_floats(threads, cap); the work runs on at
    // most `threads` threads.
    size_t cached_thread_floats(int cap) const { return (2 * (size_t)head_dim + kBlockRows) * padded(cap); }
    size_t cached_scratch_floats(int threads, int cap) const { return (size_t)threads * cached_thread_floats(cap); }
    void forward_cached(const float* qkv, const CacheRun* runs, int n_runs, float* k_cache, float* v_cache, int cap,
                        float* out, float* scratch, int threads) const {
        const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim;
        const float scale = softmax_scale();
        auto cache_at = [&](int slot, int g) { return ((size_t)slot * n_kv_head + g) * cap * hd; };
        double work = 0;  // multiply-adds, to decide whether threads pay
        for (int r = 0; r < n_runs; r++) {
            const CacheRun& run = runs[r];
            for (int t = 0; t < run.len; t++) {
                const float* row = qkv + (size_t)(run.row + t) * stride;
                for (int g = 0; g < n_kv_head; g++) {
                    const size_t at = cache_at(run.slot, g) + (size_t)((run.start + t) % cap) * hd;
                    std::memcpy(k_cache + at, row + (n_head + g) * hd, sizeof(float) * hd);
                    std::memcpy(v_cache + at, row + (n_head + n_kv_head + g) * hd, sizeof(float) * hd);
                }
            }
            work += 2.0 * run.len * (run.start + run.len - first_key(run.start)) * hd * n_head;
        }
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads) if (work > 1e5)
        for (int r = 0; r < n_runs; r++)
            for (int h = 0; h < n_head; h++) {
                const CacheRun& run = runs[r];
                const size_t at = cache_at(run.slot, h / group);
                const float *kc = k_cache + at, *vc = v_cache + at;
                const float* q = qkv + (size_t)run.row * stride + h * hd;
                float* o = out + (size_t)run.row * n_head * hd + h * hd;
                float* mine = scratch + (size_t)omp_get_thread_num() * cached_thread_floats(cap);
                if (run.len < kBlockRows) {
                    for (int t = 0; t < run.len; t++) {
                        // Positions first..p, at ring rows first % cap on, wrapping once at most.
                        const int p = run.start + t, first = first_key(p), n = p + 1 - first, at0 = first % cap;
                        const int n1 = std::min(n, cap - at0);
                        attention_forward_row(q + (size_t)t * stride, kc + (size_t)at0 * hd, vc + (size_t)at0 * hd,
                                              mine, o + (size_t)t * n_head * hd, hd, n1, hd, scale, softcap, kc, vc,
                                              n - n1);
                    }
                    continue;
                }
                // The keys the run's rows see, positions k0..keys-1, in order: transposed into kt,
                // the values gathered into vg where the ring wraps.
                const int k0 = first_key(run.start), keys = run.start + run.len, n = keys - k0, Tp = padded(n);
                float *kt = mine, *vg = kt + (size_t)hd * Tp, *block = vg + (size_t)hd * Tp;
                const int at0 = k0 % cap, n1 = std::min(n, cap - at0);
                transpose_rows(kc + (size_t)at0 * hd, hd, n1, hd, kt, Tp);
                const float* v = vc + (size_t)at0 * hd;
                if (n1 < n) {
                    for (int d = 0; d < hd; d++)  // the wrapped keys after the first n1
                        for (int j = n1; j < n; j++) kt[(size_t)d * Tp + j] = kc[(size_t)(j - n1) * hd + d];
                    std::memcpy(vg, v, sizeof(float) * n1 * hd);
                    std::memcpy(vg + (size_t)n1 * hd, vc, sizeof(float) * (n - n1) * hd);
                    v = vg;
                }
                int t0 = 0;
                for (; t0 + kBlockRows <= run.len; t0 += kBlockRows)
                    cached_rows<kBlockRows>(q, stride, kt, v, o, block, run.start, k0, t0, Tp, scale);
                for (; t0 < run.len; t0++) cached_rows<1>(q, stride, kt, v, o, block, run.start, k0, t0, Tp, scale);
            }
    }

    // Rows t0..t0+R-1 of a run starting at position start: scores against the keys of positions
    // k0..start+t0+R-1 (kt, transposed, Tp apart; v, rows of hd), each row's causal softmax over
    // the keys its window leaves it, output.
    template <int R>
    void cached_rows(const float* q, int stride, const float* kt, const float* v, float* o, float* block, int start,
                     int k0, int t0, int Tp, float scale) const {
        const int hd = head_dim, n = start + t0 + R - k0;
        tile_rows_dot_cols<R>(q + (size_t)t0 * stride, stride, kt, Tp, hd, padded(n), block, Tp);
        for (int r = 0; r < R; r++) {
            float* s = block + (size_t)r * Tp;
            const int keys = start + t0 + r + 1 - k0, first = first_key(start + t0 + r) - k0;
            float sc = scale;
            if (softcap > 0.0f) {
                for (int j = first; j < keys; j++) s[j] = softcap * fast_tanh(scale * s[j] / softcap);
                sc = 1.0f;
            }
            const float mx = row_max(s + first, keys - first);
            float sum = 0.0f;
            for (int j = first; j < keys; j++) {
                s[j] = fast_exp(sc * (s[j] - mx));
                sum += s[j];
            }
            const float inv = 1.0f / sum;
            for (int j = 0; j < first; j++) s[j] = 0.0f;
            for (int j = first; j < keys; j++) s[j] *= inv;
            for (int j = keys; j < n; j++) s[j] = 0.0f;
        }
        tile_weighted_rows<R>(block, Tp, v, hd, n, hd, o + (size_t)t0 * n_head * hd, (size_t)n_head * hd);
    }

    // Writes d_qkv (all three parts), the probabilities rebuilt from the scores and the saved
    // lse. One task per (batch, kv head): it owns that head's dk, dv, so no two threads write
    // the same element. Per thread, beside the forward's scratch: that head's dk and dv summed
    // in rows of hd floats, then written into d_qkv once. Summed in place, their rows lie a qkv
    // row apart, and every block of query rows reads and writes all of them again: a third of
    // the time of llama-3.2-1b's attention on a Zen 3 went to those reads (perf). The sums are
    // the same, term for term. scratch: pullback_scratch_floats(threads, T).
    size_t pullback_thread_floats(int T) const { return thread_scratch_floats(T) + 2 * (size_t)head_dim * padded(T); }
    size_t pullback_scratch_floats(int threads, int T) const { return (size_t)threads * pullback_thread_floats(T); }
    void pullback(const float* qkv, const int32_t* positions, const int32_t* hidden, const float* lse,
                  const float* d_out, float* d_qkv, float* scratch, int B, int T) const;
    template <int R>
    void pullback_rows(const float* q, const float* k, const float* kt, const float* vt, const int32_t* pos,
                       const int32_t* hid, const float* lse, const float* dout, float* dq, float* dk, float* dv,
                       size_t ldkv, float* block, int t0, int T, float scale) const;

    // The Clad backend's pullback: Clad's gradient of attention_forward_rows, one task per
    // (batch, kv head) as in pullback (defined below, compiled only into a Clad build). Its
    // forward sweep recomputes each block's softmax instead of reading lse. Per thread: keys
    // and values transposed (hd x padded T each), the scores, exponentials, probabilities and
    // their adjoints (a block of rows each). scratch: clad_scratch_floats().
    size_t clad_thread_floats(int T) const { return (2 * (size_t)head_dim + 6 * kBlockRows) * padded(T); }
    size_t clad_scratch_floats(int threads, int T) const { return (size_t)threads * clad_thread_floats(T); }
    void pullback_clad(const float* qkv, const int32_t* positions, const int32_t* hidden, const float* d_out,
                       float* d_qkv, float* scratch, int B, int T) const;
};

// The registry entry (native/blocks/registry.hpp): d_qkv written; lse is the forward's (the Clad
// pullback replays it instead).
using AttentionPullback = void (*)(const Attention& a, const float* qkv, const int32_t* positions,
                                   const int32_t* hidden, const float* lse, const float* d_out, float* d_qkv,
                                   float* scratch, int B, int T);
void attention_pullback_clad(const Attention& a, const float* qkv, const int32_t* positions, const int32_t* hidden,
                             const float* lse, const float* d_out, float* d_qkv, float* scratch, int B, int T);
inline const FixedBlock<AttentionPullback> attention_block{
    "attention",
    [](const Attention& a, const float* qkv, const int32_t* positions, const int32_t* hidden, const float* lse,
       const float* d_out, float* d_qkv, float* scratch, int B, int T) {
        a.pullback(qkv, positions, hidden, lse, d_out, d_qkv, scratch, B, T);
    },
    ZOO_CLAD_FN(attention_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
namespace clad::custom_derivatives::zoo {
// The products' derivatives. Scores: dq += scale ds k, dk += scale ds^T q; s was written, so
// its adjoint is consumed (zeroed). The scale is a constant: no adjoint.
inline void attention_scores_pullback(const float* q, const float* k, const float* kt, float* s, int R, int n, int hd,
                                      int stride, int Tp, float scale, float* d_q, float* d_k, float* d_s, int*, int*,
                                      int*, int*, int*, float*) {
    using namespace ::zoo;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) d_s[(size_t)r * Tp + j] *= scale;
    if (R == kAttentionBlockRows) {
        tile_weighted_rows<kAttentionBlockRows, true>(d_s, Tp, k, stride, n, hd, d_q, stride);
        tile_add_weighted_cols<kAttentionBlockRows>(d_s, Tp, q, stride, n, hd, d_k, stride);
    } else {
        for (int r = 0; r < R; r++) {
            tile_weighted_rows<1, true>(d_s + (size_t)r * Tp, Tp, k, stride, n, hd, d_q + (size_t)r * stride, stride);
            tile_add_weighted_cols<1>(d_s + (size_t)r * Tp, Tp, q + (size_t)r * stride, stride, n, hd, d_k, stride);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < attention_padded(n); j++) d_s[(size_t)r * Tp + j] = 0.0f;
}
// The cap's derivative from the capped scores (the forward left them in s).
inline void attention_cap_scores_pullback(float* s, int R, int t0, int Tp, float cap, float* d_s, int*, int*, int*,
                                          float*) {
    if (cap <= 0.0f) return;
    for (int r = 0; r < R; r++)
        for (int j = 0; j <= t0 + r; j++) {
            const float t = s[(size_t)r * Tp + j] / cap;
            d_s[(size_t)r * Tp + j] *= 1.0f - t * t;
        }
}
// Weighted values: the replay does nothing (nothing reads o); dp += do v^T, dv += p^T do.
inline void attention_weighted_values_reverse_forw(const float*, const float*, const float*, float*, int, int, int,
                                                   int, int, int, const float*, const float*, const float*, float*,
                                                   int, int, int,
                                                   int, int, int, clad::pullback_state<>&) {}
inline void attention_weighted_values_pullback(const float* p, const float* v, const float* vt, float* o, int R,
                                               int n, int hd, int stride, int ldo, int Tp, float* d_p, float* d_v,
                                               float* d_o, int*, int*, int*, int*, int*, int*,
                                               clad::pullback_state<>) {
    using namespace ::zoo;
    if (R == kAttentionBlockRows) {
        tile_rows_dot_cols<kAttentionBlockRows, true>(d_o, ldo, vt, Tp, hd, attention_padded(n), d_p, Tp);
        tile_add_weighted_cols<kAttentionBlockRows>(p, Tp, d_o, ldo, n, hd, d_v, stride);
    } else {
        for (int r = 0; r < R; r++) {
            tile_rows_dot_cols<1, true>(d_o + (size_t)r * ldo, ldo, vt, Tp, hd, attention_padded(n),
                                        d_p + (size_t)r * Tp, Tp);
            tile_add_weighted_cols<1>(p + (size_t)r * Tp, Tp, d_o + (size_t)r * ldo, ldo, n, hd, d_v, stride);
        }
    }
}
}  // namespace clad::custom_derivatives::zoo

void zoo::Attention::pullback_clad(const float* qkv, const int32_t* positions, const int32_t* hidden,
                                   const float* d_out, float* d_qkv, float* scratch, int B, int T) const {
    const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim, Tp = padded(T), ldo = n_head * hd;
    const float scale = softmax_scale();
#pragma omp parallel
    {
        auto grad = clad::gradient(attention_forward_rows, "q, k, v, s, e, p, o");
        float* kt = scratch + omp_get_thread_num() * clad_thread_floats(T);
        const size_t blk = (size_t)kBlockRows * Tp;
        float *vt = kt + (size_t)hd * Tp, *s = vt + (size_t)hd * Tp, *e = s + blk, *p = e + blk;
        float *ds = p + blk, *de = ds + blk, *dp = de + blk;
        // The adjoints of s, e and p start at zero; each block's gradient leaves them so.
        for (size_t i = 0; i < 3 * blk; i++) ds[i] = 0.0f;
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int g = 0; g < n_kv_head; g++) {
                const float* base = qkv + (size_t)b * T * stride;
                float* dbase = d_qkv + (size_t)b * T * stride;
                const float* k = base + (n_head + g) * hd;
                const float* v = base + (n_head + n_kv_head + g) * hd;
                float* dk = dbase + (n_head + g) * hd;
                float* dv = dbase + (n_head + n_kv_head + g) * hd;
                transpose_rows(k, stride, T, hd, kt, Tp);
                transpose_rows(v, stride, T, hd, vt, Tp);
                // The gradient adds into dq, dk, dv; this pullback writes them.
                for (int t = 0; t < T; t++) {
                    float* row = dbase + (size_t)t * stride;
                    std::memset(row + g * group * hd, 0, sizeof(float) * group * hd);
                    std::memset(dk + (size_t)t * stride, 0, sizeof(float) * hd);
                    std::memset(dv + (size_t)t * stride, 0, sizeof(float) * hd);
                }
                const int32_t* pos = positions ? positions + (size_t)b * T : nullptr;
                const int32_t* hid = hidden ? hidden + 2 * (size_t)b * T : nullptr;
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int t0 = 0; t0 < T;) {
                        const int R = t0 + kBlockRows <= T ? kBlockRows : 1;
                        // keys first..t less [lo, hi): the row's packed example less a hidden span
                        int first[kBlockRows], lo[kBlockRows], hi[kBlockRows];
                        for (int r = 0; r < R; r++) {
                            const VisibleKeys vis = visible(pos, hid, t0 + r);
                            first[r] = vis.first, lo[r] = vis.lo, hi[r] = vis.hi;
                        }
                        // The output's adjoint passes through the add: read where it lies.
                        float* dout = const_cast<float*>(d_out) + ((size_t)b * T + t0) * ldo + h * hd;
                        grad.execute(base + (size_t)t0 * stride + h * hd, k, kt, v, vt, s, e, p, nullptr, first, lo,
                                     hi, t0, R, hd, stride, ldo, Tp, scale, softcap, dbase + (size_t)t0 * stride + h * hd, dk,
                                     dv, ds, de, dp, dout);
                        t0 += R;
                    }
            }
    }
}

void zoo::attention_pullback_clad(const Attention& a, const float* qkv, const int32_t* positions,
                                  const int32_t* hidden, const float*, const float* d_out, float* d_qkv, float* scratch,
                                  int B, int T) {
    a.pullback_clad(qkv, positions, hidden, d_out, d_qkv, scratch, B, T);
}
#endif

inline void zoo::Attention::pullback(const float* qkv, const int32_t* positions, const int32_t* hidden,
                                     const float* lse, const float* d_out, float* d_qkv, float* scratch, int B,
                                     int T) const {
    const int stride = qkv_dim(), group = n_head / n_kv_head, hd = head_dim, Tp = padded(T);
    const float scale = softmax_scale();
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < n_kv_head; g++) {
            float* kt = scratch + (size_t)omp_get_thread_num() * pullback_thread_floats(T);
            float* vt = kt + (size_t)hd * Tp;
            float* block = vt + (size_t)hd * Tp;
            float* dk_sum = block + 2 * (size_t)kBlockRows * Tp;  // T rows of hd: the head's dk, then dv
            float* dv_sum = dk_sum + (size_t)hd * Tp;
            const float* base = qkv + (size_t)b * T * stride;
            float* dbase = d_qkv + (size_t)b * T * stride;
            const float* k = base + (n_head + g) * hd;
            float* dk = dbase + (n_head + g) * hd;
            float* dv = dbase + (n_head + n_kv_head + g) * hd;
            transpose_rows(k, stride, T, hd, kt, Tp);
            transpose_rows(base + (n_head + n_kv_head + g) * hd, stride, T, hd, vt, Tp);
            std::memset(dk_sum, 0, sizeof(float) * T * hd);
            std::memset(dv_sum, 0, sizeof(float) * T * hd);
            for (int h = g * group; h < (g + 1) * group; h++) {
                const float* q = base + h * hd;
                float* dq = dbase + h * hd;
                const float* l = lse + ((size_t)b * n_head + h) * T;
                const float* dout = d_out + (size_t)b * T * n_head * hd + h * hd;
                const int32_t* pos = positions ? positions + (size_t)b * T : nullptr;
                const int32_t* hid = hidden ? hidden + 2 * (size_t)b * T : nullptr;
                int t0 = 0;
                for (; t0 + kBlockRows <= T; t0 += kBlockRows)
                    pullback_rows<kBlockRows>(q, k, kt, vt, pos, hid, l, dout, dq, dk_sum, dv_sum, hd, block, t0, T,
                                              scale);
                for (; t0 < T; t0++)
                    pullback_rows<1>(q, k, kt, vt, pos, hid, l, dout, dq, dk_sum, dv_sum, hd, block, t0, T, scale);
            }
            for (int t = 0; t < T; t++) {
                std::memcpy(dk + (size_t)t * stride, dk_sum + (size_t)t * hd, sizeof(float) * hd);
                std::memcpy(dv + (size_t)t * stride, dv_sum + (size_t)t * hd, sizeof(float) * hd);
            }
        }
}

// Query rows t0..t0+R-1 of one head (q, dq rows qkv_dim apart; dout rows n_head*hd apart):
// writes their dq, adds into dk and dv of keys 0..t0+R-1 (rows ldkv apart). block: two R x
// padded(T) blocks, the probabilities (zero outside each row's visible keys) and the score adjoints.
template <int R>
inline void zoo::Attention::pullback_rows(const float* q, const float* k, const float* kt, const float* vt,
                                          const int32_t* pos, const int32_t* hid, const float* lse, const float* dout,
                                          float* dq, float* dk, float* dv, size_t ldkv, float* block, int t0, int T,
                                          float scale) const {
    const int stride = qkv_dim(), hd = head_dim, Tp = padded(T), n = t0 + R;
    const size_t ldo = (size_t)n_head * hd;
    float* pb = block;
    float* ds = block + (size_t)R * Tp;
    const float* q0 = q + (size_t)t0 * stride;
    const float* dout0 = dout + (size_t)t0 * ldo;
    tile_rows_dot_cols<R>(q0, stride, kt, Tp, hd, padded(n), pb, Tp);      // S = Q K^T
    tile_rows_dot_cols<R>(dout0, ldo, vt, Tp, hd, padded(n), ds, Tp);     // dP = dO V^T
    for (int r = 0; r < R; r++) {
        const int keys = t0 + r + 1;
        const VisibleKeys vis = visible(pos, hid, t0 + r);
        const int run_begin[2] = {vis.first, vis.hi}, run_end[2] = {vis.lo, keys};  // as in forward_rows
        const float l = lse[t0 + r];
        float* pr = pb + (size_t)r * Tp;
        float* dsr = ds + (size_t)r * Tp;
        // dS = P (dP - sum P dP): a row's terms sum to zero. What they sum to instead goes into
        // dQ = dS K times the keys' common part (large under a norm with a bias), and is all of
        // the k bias's gradient. The probabilities rebuilt from the saved lse sum to 1 only
        // within a few ulps of the scores (recomputed here in another order), so sum P dP is
        // divided by sum P: the normalized probabilities' weighted mean. In variants of
        // tests/test_variants.py's neox-like model, q and k gradients were 1.9-4.8x PyTorch
        // float32's error without it, 1.2-3.6x with it.
        float dot = 0.0f, total = 0.0f;
        if (softcap > 0.0f) {
            // p = exp(c tanh(scale s / c) - lse); d(capped)/ds = scale (1 - tanh^2). The first
            // pass only sums (the scores stay for the second, which recomputes the tanh).
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) {
                    const float p = fast_exp(softcap * fast_tanh(scale * pr[j] / softcap) - l);
                    dot += p * dsr[j];
                    total += p;
                }
            const float mean = dot / total;
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) {
                    const float t = fast_tanh(scale * pr[j] / softcap);
                    pr[j] = fast_exp(softcap * t - l);
                    dsr[j] = pr[j] * (dsr[j] - mean) * scale * (1.0f - t * t);
                }
        } else {
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) {
                    pr[j] = fast_exp(scale * pr[j] - l);
                    dot += pr[j] * dsr[j];
                    total += pr[j];
                }
            const float mean = dot / total;
            for (int run = 0; run < 2; run++)
                for (int j = run_begin[run]; j < run_end[run]; j++) dsr[j] = pr[j] * (dsr[j] - mean) * scale;
        }
        for (int j = 0; j < vis.first; j++) pr[j] = dsr[j] = 0.0f;
        for (int j = vis.lo; j < vis.hi; j++) pr[j] = dsr[j] = 0.0f;
        for (int j = keys; j < n; j++) pr[j] = dsr[j] = 0.0f;
    }
    tile_add_weighted_cols<R>(pb, Tp, dout0, ldo, n, hd, dv, ldkv);       // dV += P^T dO
    tile_weighted_rows<R>(ds, Tp, k, stride, n, hd, dq + (size_t)t0 * stride, stride);  // dQ = dS K
    tile_add_weighted_cols<R>(ds, Tp, q0, stride, n, hd, dk, ldkv);       // dK += dS^T Q
}
