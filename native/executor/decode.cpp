// Generation's few rows (at most gemv::max_rows: one new token per sequence) through every
// layer in one parallel region. Each new token reads every weight once, so the time is the
// weights' bandwidth plus whatever makes the threads wait for each other; here that is five
// barriers a layer, where a pass of the layer's blocks one call at a time starts a parallel
// region (a fork and a join) for each of its nine steps:
//   - the norms run on every thread, each into its own buffer, and each thread prepares its
//     own copy of the product's operand from it: no barrier between a norm and its product;
//   - the threads take the rows of each matrix a chunk at a time from a counter (gemv.hpp):
//     on a machine shared with other work, a thread the system sets aside holds up only the
//     chunk it has, and the others take the rest;
//   - RoPE, the KV cache append and attention go together, one task per (sequence, KV head);
//   - the MLP's activation follows its input product on the units each thread took (for a
//     gated activation, gate row o and up row d_ff + o go to the same thread).
// The sequential layer over a base without adapters, with the variants' options that act inside
// a head or a scale (Dims::fused_decode_options); others take Executor::cached_chunk.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/gemv.hpp"
#include "layers/layers.hpp"

namespace zoo {

namespace {
size_t line_floats(size_t n) { return (n + 15) / 16 * 16; }  // whole cache lines: threads share none
}  // namespace

// Per thread: its norm output and statistics over the rows, its copy of a product's operand, and
// where its share of a gated activation's input is gathered.
size_t decode_thread_floats(const Dims& d) {
    const size_t rows = gemv::max_rows;
    return line_floats(rows * d.d_model) + line_floats(rows * d.norm->stats_per_row) +
           line_floats(gemv::scratch_floats(gemv::max_rows, d.widest_input())) + line_floats(d.fc_dim());
}

bool Executor::fused_decode(int rows) const {
    return rows <= gemv::max_rows && !d_.layer->parallel && !has_adapters_ && d_.fused_decode_options();
}

void Executor::decode_chunk(int rows) {
    const Dims& d = d_;
    const int D = d.d_model, F = d.d_ff, gate = d.mlp->gate_width, hd = d.head_dim, half = d.rotary_half();
    const int qkv_dim = d.qkv_dim(), attn_dim = d.attn_dim(), fc_dim = d.fc_dim();
    const int n_kv = d.n_kv_head, group = d.n_head / d.n_kv_head, tasks = chunk_n_runs_ * n_kv;
    const float scale = d.softmax_scale(), softcap = d.attention_softcap;
    const Attention attn{d.n_head, d.n_kv_head, hd};
    const gemv::Isa isa = gemv::best_isa();
    const Precision p = precision_;
    const LayerActs& a = cached_;
    float* x = a.out;  // the residual stream, updated in place
    const bool timing = profile.on;
    std::atomic<int>* counters = decode_next_.get();
    for (int k = 0; k < 4 * d.n_layer; k++) counters[k].store(0, std::memory_order_relaxed);
#pragma omp parallel num_threads(cache_threads_)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        float* ln = c_decode_scratch_ + (size_t)t * decode_thread_floats(d);
        float* stats = ln + line_floats((size_t)gemv::max_rows * D);
        float* operand = stats + line_floats((size_t)gemv::max_rows * d.norm->stats_per_row);
        float* gathered = operand + line_floats(gemv::scratch_floats(gemv::max_rows, d.widest_input()));
        float* probs = c_attention_scratch_ + (size_t)t * attn.cached_thread_floats(cache_len_);
        // Thread 0 times the steps, the wait at the barrier after each included.
        double t0 = timing ? Profile::now() : 0.0;
        auto lap = [&](ProfileSlot slot) {
            if (!timing || t) return;
            const double now = Profile::now();
            profile.forward[slot] += now - t0;
            t0 = now;
        };
        // work(r0, r1) over the chunks of R rows this thread takes from the counter next.
        auto take = [&](std::atomic<int>& next, int R, auto&& work) { gemv::take_rows(next, R, n, work); };
        // y = r + x W^T + b over the rows this thread takes, x prepared on this thread.
        auto product = [&](std::atomic<int>& next, const float* in, int ld, const Matrix& W, const float* b,
                           const float* r, float* y, int ldy) {
            const gemv::Operand op = gemv::prepare(p, rows, in, ld, W, operand, isa);
            take(next, W.rows, [&](int r0, int r1) { gemv::rows(op, W, r0, r1, b, r, ldy, y, ldy); });
        };
#pragma omp single
        {
            Embedding{D}.forward(chunk_tokens_.data(), chunk_positions_.data(), wm_.wte, w_.wpe, x, 1, rows);
            if (d.embedding_scale != 1.0f)
                for (size_t k = 0; k < (size_t)rows * D; k++) x[k] *= d.embedding_scale;
        }
        lap(k_embedding);
        for (int i = 0; i < d.n_layer; i++) {
            const LayerTensors& w = w_.layers[i];
            const LayerMatrices& wm = wm_.layers[i];
            d.norm->forward({D, d.norm_eps, rows, x, w.ln1_w, w.ln1_b, stats}, ln);
            lap(k_norm);
            std::atomic<int>* next = counters + 4 * i;  // this layer's four products'
            product(next[0], ln, D, wm.qkv_w, w.qkv_b, nullptr, a.qkv, qkv_dim);
#pragma omp barrier
            lap(k_linear);
            // Task (run, g): the run's keys of KV head g rotated and put in the cache with its
            // values, then the group's query heads rotated and attending.
            // The layer's options: q and k RMS-normalized per head (Qwen3, Gemma 3), then rotated by
            // its table (none in a NoPE layer, the local one in a sliding layer), its keys in a
            // ring of cap positions where it has a window (a query sees positions first..p).
            const Attention layer_attn = attention(i);
            const bool rotates = layer_rotates(i);
            const float *cos_i = rope_cos(i), *sin_i = rope_sin(i);
            const int cap = cache_cap_[i];
            auto qk_norm = [&](float* v, const float* nw) {  // one head's row, in place (through ln)
                d.norm->forward({hd, d.norm_eps, 1, v, nw, nullptr, stats}, ln);
                std::memcpy(v, ln, sizeof(float) * hd);
            };
            for (int task = t; task < tasks; task += n) {
                const CacheRun& run = chunk_runs_[task / n_kv];
                const int g = task % n_kv;
                const size_t at = cache_offset_[i] + ((size_t)run.slot * n_kv + g) * cap * hd;
                float *kc = k_cache_ + at, *vc = v_cache_ + at;
                for (int r = 0; r < run.len; r++) {
                    float* row = a.qkv + (size_t)(run.row + r) * qkv_dim;
                    const size_t pos = run.start + r, ring = pos % cap;
                    float* k = row + (size_t)(d.n_head + g) * hd;
                    if (d.qk_norm) qk_norm(k, w.k_norm_w);
                    if (rotates) rope_forward_row(k, cos_i + pos * half, sin_i + pos * half, half);
                    std::memcpy(kc + ring * hd, k, sizeof(float) * hd);
                    std::memcpy(vc + ring * hd, row + (size_t)(d.n_head + n_kv + g) * hd, sizeof(float) * hd);
                }
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int r = 0; r < run.len; r++) {
                        float* q = a.qkv + (size_t)(run.row + r) * qkv_dim + (size_t)h * hd;
                        const int pos = run.start + r;
                        if (d.qk_norm) qk_norm(q, w.q_norm_w);
                        if (rotates) rope_forward_row(q, cos_i + (size_t)pos * half, sin_i + (size_t)pos * half, half);
                        // Positions first..pos at ring rows first % cap on, wrapping once at most.
                        const int first = layer_attn.first_key(pos), keys = pos + 1 - first, at0 = first % cap;
                        const int n1 = std::min(keys, cap - at0);
                        attention_forward_row(q, kc + (size_t)at0 * hd, vc + (size_t)at0 * hd, probs,
                                              a.att + (size_t)(run.row + r) * attn_dim + (size_t)h * hd, hd, n1, hd,
                                              scale, softcap, kc, vc, keys - n1);
                    }
            }
#pragma omp barrier
            lap(k_attention);
            product(next[1], a.att, attn_dim, wm.attn_out_w, w.attn_out_b, x, x, D);
#pragma omp barrier
            lap(k_linear);
            d.norm->forward({D, d.norm_eps, rows, x, w.ln2_w, w.ln2_b, stats}, ln);
            lap(k_norm);
            // The MLP's units [f0, f1) this thread takes: their rows of each gate part, then the
            // activation (timed as linear here).
            {
                const gemv::Operand op = gemv::prepare(p, rows, ln, D, wm.fc_w, operand, isa);
                take(next[2], F, [&](int f0, int f1) {
                    const int width = f1 - f0;
                    for (int part = 0; part < gate; part++)
                        gemv::rows(op, wm.fc_w, part * F + f0, part * F + f1, w.fc_b, nullptr, fc_dim, a.fc, fc_dim);
                    for (int m = 0; m < rows; m++) {
                        for (int part = 0; part < gate; part++)
                            std::memcpy(gathered + (size_t)part * width,
                                        a.fc + (size_t)m * fc_dim + (size_t)part * F + f0, sizeof(float) * width);
                        d.mlp->forward(width, gathered, a.act + (size_t)m * F + f0, 1);
                    }
                });
            }
#pragma omp barrier
            lap(k_linear);
            product(next[3], a.act, F, wm.proj_w, w.proj_b, x, x, D);
#pragma omp barrier
            lap(k_linear);
        }
    }
}

}  // namespace zoo
