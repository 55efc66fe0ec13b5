// Layer arrangements (ModelConfig.layer): how a layer composes its blocks. The default,
// sequential (x + attn(norm1(x)), then + mlp(norm2(.))), is the executor's own hand-chained
// layer. Any other is written here as a forward over the block calls below, and nothing more:
// its pullback is Clad's gradient of that forward (clad::gradient of a function of block
// calls), and each block call has the block's pullback as its Clad custom derivative, so Clad
// chains the blocks' pullbacks (the hand-written ones or Clad's, as the model's ad= picks) in
// reverse, fan-outs summed. A new arrangement: its header in layers/, one line in
// layer_arrangements (docs/adding_a_block.md).
#pragma once
#include <omp.h>

#include <cstring>
#include <string>

#include "kernels/bf16.hpp"
#include "kernels/gemv.hpp"
#include "executor/model.hpp"

// Clad treats a type marked so as opaque: a LayerCall argument gets no adjoint, and Clad never
// looks inside it. Only clang knows the attribute; every translation unit of a Clad build is
// compiled by clang, so the type is the same everywhere.
#if defined(__clang__)
#define ZOO_CLAD_OPAQUE __attribute__((annotate("non_differentiable")))
#else
#define ZOO_CLAD_OPAQUE
#endif

namespace zoo {

// One call of a layer: everything its block calls need besides the tensors the forward passes
// explicitly (those are what Clad differentiates). Filled by Executor::layer_call.
struct ZOO_CLAD_OPAQUE LayerCall {
    const Dims* d;
    Precision precision;
    const Pullbacks* pb;          // the model's block pullbacks (ad=)
    const LayerTensors* w;        // the layer's weights
    LayerTensors* g;              // and gradients
    const LayerActs* a;           // its buffers
    const ActivationPlan* plan;   // the adjoints and scratch its pullback uses (training only)
    const float *rope_cos, *rope_sin;
    const int32_t* positions;     // the step's packed positions, or null
    const int32_t* hidden;        // and its rows' hidden key spans, or null (block.hpp)
    float* attention_scratch;     // (generation: the cache's)
    float *k_cache, *v_cache;     // generation: this layer's KV cache,
    int cache_len;
    const CacheRun* runs;         // the call's runs of rows (Attention::forward_cached)
    int n_runs, cache_threads;
    float* decode_scratch;        // and the decode products' (gemv.hpp)
    int B, T, pos0;
    LayerPass pass;
    GradMode mode;                // the gradient lifecycle's: write or add the parameter gradients
    Profile* profile;             // the executor's per-block wall times

    int N() const { return B * T; }
    // The sizes an arrangement's forward passes to its block calls (member calls of an opaque
    // type: Clad leaves them alone).
    int d_model() const { return d->d_model; }
    int d_ff() const { return d->d_ff; }
    int qkv_dim() const { return d->qkv_dim(); }
    int attn_dim() const { return d->attn_dim(); }
    int fc_dim() const { return d->fc_dim(); }
    Linear linear(int in, int out) const { return Linear{in, out, precision}; }
    Attention attention() const { return Attention{d->n_head, d->n_kv_head, d->head_dim, 0, d->softmax_scale()}; }
    // Outputs kept per layer are recomputed by no replay; outputs in buffers every layer shares are.
    bool replay() const { return pass == LayerPass::replay; }
};

// Adds its scope's wall time to the profile's slot while profiling is on: as forward time, or
// as pullback time in the custom derivatives and in a pullback's replay (where the sequential
// layer counts its recomputes too).
struct LayerTimer {
    Profile* profile;
    ProfileSlot slot;
    bool pullback;
    double t0;
    LayerTimer(const LayerCall* c, ProfileSlot s, bool in_pullback)
        : profile(c->profile->on ? c->profile : nullptr), slot(s), pullback(in_pullback || c->replay()),
          t0(profile ? omp_get_wtime() : 0.0) {}
    ~LayerTimer() {
        if (profile) (pullback ? profile->pullback : profile->forward)[slot] += omp_get_wtime() - t0;
    }
};

// A bf16 step keeps a layer's q|k|v, attention output and MLP input in bf16 (bf16.hpp): its
// pullback first widens them into the fp32 buffers the layers share.
inline void expand_saved_bf16(const Dims& d, const LayerActs& a, size_t N) {
    if (!a.qkv_bf16) return;
    expand_bf16(a.qkv_bf16, a.qkv, N * d.qkv_dim());
    expand_bf16(a.att_bf16, a.att, N * d.attn_dim());
    expand_bf16(a.fc_bf16, a.fc, N * d.fc_dim());
}

// --- block calls: what an arrangement's forward is written in --------------------------------
// Each runs its block forward (all of it in training and generation; in a pullback's replay
// only where the output lives in a buffer every layer shares: the norm output and the MLP
// activation). Their Clad custom derivatives (below, Clad build only) call the model's block
// pullbacks and follow Clad's convention: they add into the adjoints of their inputs, and the
// layer pullback starts every adjoint at zero. Sizes are int arguments (Clad passes them
// through); c carries the rest.

// y = norm(x) * w (+ b); stats: the layer's ln1_stats (slot 1) or ln2_stats (slot 2).
inline float* norm_stats(const LayerCall* c, int slot) { return slot == 1 ? c->a->ln1_stats : c->a->ln2_stats; }
inline void layer_norm_call(const float* x, const float* w, const float* b, float* y, int slot, const LayerCall* c) {
    const LayerTimer timer(c, k_norm, false);
    const Dims& d = *c->d;
    d.norm->forward({d.d_model, d.norm_eps, c->N(), x, w, b, norm_stats(c, slot)}, y);
}

// y = r + x W^T + b (r may be null, or y): generation's few rows on the decode kernels.
inline void layer_product(const float* x, const float* W, const float* b, const float* r, float* y, int in, int out,
                          const LayerCall* c) {
    if (c->pass == LayerPass::cached && c->N() <= gemv::max_rows)
        gemv::product(c->precision, c->N(), x, in, Matrix(W, DType::f32, out, in), b, r, out, y, out,
                      c->decode_scratch);
    else
        c->linear(in, out).forward(x, W, b, y, c->N(), r);
}

// y = x W^T + b.
inline void layer_linear_call(const float* x, const float* W, const float* b, float* y, int in, int out,
                              const LayerCall* c) {
    const LayerTimer timer(c, k_linear, false);
    if (!c->replay()) layer_product(x, W, b, nullptr, y, in, out, c);
}

// y = r + x W^T + b: a projection into the residual stream r (r may be y in generation, where
// the stream is updated in place). The recompute before a checkpointed pullback skips it.
inline void layer_residual_linear_call(const float* x, const float* W, const float* b, const float* r, float* y,
                                       int in, int out, const LayerCall* c) {
    const LayerTimer timer(c, k_linear, false);
    if (!c->replay() && c->pass != LayerPass::recompute) layer_product(x, W, b, r, y, in, out, c);
}

// y += x W^T + b: a second projection into the same residual stream.
inline void layer_accumulate_linear_call(const float* x, const float* W, const float* b, float* y, int in, int out,
                                         const LayerCall* c) {
    const LayerTimer timer(c, k_linear, false);
    if (!c->replay() && c->pass != LayerPass::recompute) layer_product(x, W, b, y, y, in, out, c);
}

// RoPE on the q and k heads of qkv, in place (nothing without RoPE positions).
inline void layer_rope_call(float* qkv, const LayerCall* c) {
    const LayerTimer timer(c, k_rope, false);
    const Dims& d = *c->d;
    if (d.rope && !c->replay())
        RoPE{d.head_dim, d.rotary_dim}.forward(qkv, d.qkv_dim(), d.n_head + d.n_kv_head, c->rope_cos, c->rope_sin,
                                               c->B, c->T, c->positions, c->pos0);
}

// att = causal attention over qkv: over the whole sequences in training (saving lse, and in a
// bf16 step qkv and att in bf16), against the KV cache in generation.
inline void layer_attention_call(float* qkv, float* att, const LayerCall* c) {
    const LayerTimer timer(c, k_attention, false);
    const Dims& d = *c->d;
    const LayerActs& a = *c->a;
    const size_t N = c->N();
    if (c->replay()) return;
    if (c->pass == LayerPass::cached) {
        c->attention().forward_cached(qkv, c->runs, c->n_runs, c->k_cache, c->v_cache, c->cache_len, att,
                                      c->attention_scratch, c->cache_threads);
        return;
    }
    if (a.qkv_bf16) round_and_save_bf16(qkv, a.qkv_bf16, N * d.qkv_dim());
    c->attention().forward(qkv, c->positions, c->hidden, a.lse, att, c->attention_scratch, c->B, c->T);
    if (a.att_bf16) round_and_save_bf16(att, a.att_bf16, N * d.attn_dim());
}

// act = the MLP activation of fc (a bf16 step keeps fc in bf16, rounding it in place).
inline void layer_activation_call(float* fc, float* act, const LayerCall* c) {
    const LayerTimer timer(c, k_activation, false);
    const Dims& d = *c->d;
    const LayerActs& a = *c->a;  // (read through c->a->fc_bf16 directly, the call crashes Clad's analysis)
    if (a.fc_bf16 && c->pass == LayerPass::train) round_and_save_bf16(fc, a.fc_bf16, (size_t)c->N() * d.fc_dim());
    d.mlp->forward(d.d_ff, fc, act, c->N());
}

}  // namespace zoo

#ifdef ZOO_CLAD_TU
// The block calls' derivatives: the model's block pullbacks, adding into the input adjoints.
namespace clad::custom_derivatives::zoo {
using ::zoo::LayerCall;

inline void layer_norm_call_pullback(const float* x, const float* w, const float* b, float* y, int slot,
                                     const LayerCall* c, float* d_x, float* d_w, float* d_b, float* d_y, int*) {
    const ::zoo::LayerTimer timer(c, ::zoo::k_norm, true);
    const ::zoo::Dims& d = *c->d;
    // The norm pullback adds into dx by contract; its weight gradients follow the lifecycle.
    c->pb->norm({d.d_model, d.norm_eps, c->N(), x, w, b, ::zoo::norm_stats(c, slot)}, d_y, nullptr, d_x, d_w, d_b,
                c->plan->pullback_scratch, c->mode);
}

// dx += dy W (one GEMM, as in either linear pullback); dW, db from the model's linear pullback
// (given no dx, it computes the parameter part only).
inline void linear_call_pullback(const float* x, const float* W, const float* b, const float* d_y, float* d_x,
                                 float* d_W, float* d_b, int in, int out, const LayerCall* c) {
    const ::zoo::LayerTimer timer(c, ::zoo::k_linear, true);
    const ::zoo::Linear l = c->linear(in, out);
    l.pullback_input(W, d_y, d_x, c->N(), /*accumulate_dx=*/true);
    c->pb->linear(l, x, W, b, d_y, nullptr, d_W, d_b, c->N(), c->mode, c->plan->pullback_scratch);
}

inline void layer_linear_call_pullback(const float* x, const float* W, const float* b, float* y, int in, int out,
                                       const LayerCall* c, float* d_x, float* d_W, float* d_b, float* d_y, int*,
                                       int*) {
    linear_call_pullback(x, W, b, d_y, d_x, d_W, d_b, in, out, c);
}

// The residual passes its adjoint straight through: d_r += d_y.
inline void layer_residual_linear_call_pullback(const float* x, const float* W, const float* b, const float* r,
                                                float* y, int in, int out, const LayerCall* c, float* d_x,
                                                float* d_W, float* d_b, float* d_r, float* d_y, int*, int*) {
    {
        const ::zoo::LayerTimer timer(c, ::zoo::k_linear, true);  // the residual add is the linear's, as ever
        const size_t n = (size_t)c->N() * out;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) d_r[i] += d_y[i];
    }
    linear_call_pullback(x, W, b, d_y, d_x, d_W, d_b, in, out, c);
}

// y's earlier value passes through (its adjoint is d_y, unchanged).
inline void layer_accumulate_linear_call_pullback(const float* x, const float* W, const float* b, float* y, int in,
                                                  int out, const LayerCall* c, float* d_x, float* d_W, float* d_b,
                                                  float* d_y, int*, int*) {
    linear_call_pullback(x, W, b, d_y, d_x, d_W, d_b, in, out, c);
}

// In place on the adjoint, like the forward on qkv.
inline void layer_rope_call_pullback(float* qkv, const LayerCall* c, float* d_qkv) {
    const ::zoo::LayerTimer timer(c, ::zoo::k_rope, true);
    const ::zoo::Dims& d = *c->d;
    if (d.rope)
        c->pb->rope(::zoo::RoPE{d.head_dim, d.rotary_dim}, d_qkv, d.qkv_dim(), d.n_head + d.n_kv_head, c->rope_cos,
                    c->rope_sin, c->B, c->T, c->positions);
}

// The attention pullback writes d_qkv: the arrangement's one reader of qkv (the layer pullback
// zeroes it first either way).
inline void layer_attention_call_pullback(float* qkv, float* att, const LayerCall* c, float* d_qkv, float* d_att) {
    const ::zoo::LayerTimer timer(c, ::zoo::k_attention, true);
    c->pb->attention(c->attention(), qkv, c->positions, c->hidden, c->a->lse, d_att, d_qkv, c->plan->pullback_scratch,
                     c->B, c->T);
}

// The activation pullback writes d_fc: the arrangement's one reader of fc.
inline void layer_activation_call_pullback(float* fc, float* act, const LayerCall* c, float* d_fc,
                                           float* d_act) {
    const ::zoo::LayerTimer timer(c, ::zoo::k_activation, true);
    c->pb->activation(c->d->d_ff, fc, d_act, d_fc, c->N());
}
}  // namespace clad::custom_derivatives::zoo
#endif

#include "layers/parallel.hpp"

namespace zoo {

inline const LayerArrangement sequential_layer{"sequential", /*second_norm=*/true, /*parallel=*/false, nullptr,
                                               nullptr};
inline const LayerArrangement* const layer_arrangements[] = {&sequential_layer, &parallel_layer,
                                                            &parallel_two_norms_layer};
// Every block ad= names: the registry's, and the layer arrangements Clad can chain (kind "layer":
// hand-chained by the executor, Clad-chained where ad= says so).
inline std::vector<BlockInfo> ad_block_infos() {
    std::vector<BlockInfo> out = block_infos();
    for (const LayerArrangement* l : layer_arrangements)
        if (l->forward) out.push_back({l->name, "layer", true, l->pullback_clad != nullptr, true});
    return out;
}
inline const LayerArrangement& find_layer(const std::string& name) {
    return find_block(layer_arrangements, name, "layer");
}

}  // namespace zoo
