// The parallel-residual layers: attention and MLP read the layer's input and both add into the
// residual stream. parallel (GPT-J, Falcon): out = x + attn(norm(x)) + mlp(norm(x)), one norm;
// parallel_two_norms (GPT-NeoX, Pythia): out = x + attn(norm1(x)) + mlp(norm2(x)). The executor
// chains both by hand (executor.cpp: layer_forward, parallel_pullback), in every build and over
// a frozen base; each is also written here as a forward over block calls, whose pullback a Clad
// build generates (clad::gradient of the forward, chaining the blocks' pullbacks through the
// block calls' custom derivatives in layers.hpp), taken with ad= putting the layer on Clad.
#pragma once
#include <cstring>

namespace zoo {

// The layer as Clad differentiates it: block calls only. h, the norm output, feeds both
// branches, so Clad sums its adjoint from both (and x's from the norm and the residual).
inline void parallel_layer_forward(const float* x, const float* ln_w, const float* ln_b, const float* qkv_w,
                                   const float* qkv_b, const float* attn_out_w, const float* attn_out_b,
                                   const float* fc_w, const float* fc_b, const float* proj_w, const float* proj_b,
                                   float* h, float* qkv, float* att, float* fc, float* act, float* out,
                                   const LayerCall* c) {
    layer_norm_call(x, ln_w, ln_b, h, 1, c);
    layer_linear_call(h, qkv_w, qkv_b, qkv, c->d_model(), c->qkv_dim(), c);
    layer_rope_call(qkv, c);
    layer_attention_call(qkv, att, c);
    layer_linear_call(h, fc_w, fc_b, fc, c->d_model(), c->fc_dim(), c);
    layer_activation_call(fc, act, c);
    layer_residual_linear_call(att, attn_out_w, attn_out_b, x, out, c->attn_dim(), c->d_model(), c);
    layer_accumulate_linear_call(act, proj_w, proj_b, out, c->d_ff(), c->d_model(), c);
}

// Training, recompute and generation: the forward on layer c's tensors.
inline void parallel_layer_run(const LayerCall& c) {
    const LayerTensors& w = *c.w;
    const LayerActs& a = *c.a;
    parallel_layer_forward(a.x, w.ln1_w, w.ln1_b, w.qkv_w, w.qkv_b, w.attn_out_w, w.attn_out_b, w.fc_w, w.fc_b,
                           w.proj_w, w.proj_b, a.ln1, a.qkv, a.att, a.fc, a.act, a.out, &c);
}

// Clad's gradient of parallel_layer_forward (defined below, in the Clad build only). On entry
// plan->d_res holds dL/d(out); on exit dL/d(x), as the sequential layer's pullback leaves it.
void parallel_layer_pullback_clad(const LayerCall& c);

inline const LayerArrangement parallel_layer{"parallel", /*second_norm=*/false, /*parallel=*/true, parallel_layer_run,
                                             ZOO_CLAD_FN(parallel_layer_pullback_clad)};

// The two-norm form: the MLP reads norm2(x), into h2 (a buffer of its own: h is still read by
// the q|k|v product's pullback). norm2 runs before the attention's residual add, which in
// generation updates x in place.
inline void parallel_two_norms_layer_forward(const float* x, const float* ln1_w, const float* ln1_b,
                                             const float* ln2_w, const float* ln2_b, const float* qkv_w,
                                             const float* qkv_b, const float* attn_out_w, const float* attn_out_b,
                                             const float* fc_w, const float* fc_b, const float* proj_w,
                                             const float* proj_b, float* h, float* h2, float* qkv, float* att,
                                             float* fc, float* act, float* out, const LayerCall* c) {
    layer_norm_call(x, ln1_w, ln1_b, h, 1, c);
    layer_linear_call(h, qkv_w, qkv_b, qkv, c->d_model(), c->qkv_dim(), c);
    layer_rope_call(qkv, c);
    layer_attention_call(qkv, att, c);
    layer_norm_call(x, ln2_w, ln2_b, h2, 2, c);
    layer_linear_call(h2, fc_w, fc_b, fc, c->d_model(), c->fc_dim(), c);
    layer_activation_call(fc, act, c);
    layer_residual_linear_call(att, attn_out_w, attn_out_b, x, out, c->attn_dim(), c->d_model(), c);
    layer_accumulate_linear_call(act, proj_w, proj_b, out, c->d_ff(), c->d_model(), c);
}

inline void parallel_two_norms_layer_run(const LayerCall& c) {
    const LayerTensors& w = *c.w;
    const LayerActs& a = *c.a;
    parallel_two_norms_layer_forward(a.x, w.ln1_w, w.ln1_b, w.ln2_w, w.ln2_b, w.qkv_w, w.qkv_b, w.attn_out_w,
                                     w.attn_out_b, w.fc_w, w.fc_b, w.proj_w, w.proj_b, a.ln1, a.ln2, a.qkv, a.att,
                                     a.fc, a.act, a.out, &c);
}

void parallel_two_norms_layer_pullback_clad(const LayerCall& c);

inline const LayerArrangement parallel_two_norms_layer{"parallel_two_norms", /*second_norm=*/true, /*parallel=*/true,
                                                       parallel_two_norms_layer_run,
                                                       ZOO_CLAD_FN(parallel_two_norms_layer_pullback_clad)};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
void zoo::parallel_layer_pullback_clad(const LayerCall& c) {
    const Dims& d = *c.d;
    const LayerTensors& w = *c.w;
    LayerTensors& g = *c.g;
    const LayerActs& a = *c.a;
    const ActivationPlan& p = *c.plan;
    const size_t N = c.N();
    expand_saved_bf16(d, a, N);
    // Clad's gradient adds into every adjoint: they start at zero. The output's adjoint (the
    // seed, d_res) is read, never aliased by the input's, which the norm and the residual add into.
    std::memset(p.d_layer_in, 0, sizeof(float) * N * d.d_model);
    std::memset(p.d_norm, 0, sizeof(float) * N * d.d_model);
    std::memset(p.d_qkv, 0, sizeof(float) * N * d.qkv_dim());
    std::memset(p.d_att, 0, sizeof(float) * N * d.attn_dim());
    std::memset(p.d_fc, 0, sizeof(float) * N * d.fc_dim());
    std::memset(p.d_act, 0, sizeof(float) * N * d.d_ff);
    // The gradient's forward sweep runs the forward in replay (c.pass): it recomputes the norm
    // output and the activation, which live in buffers every layer shares; the per-layer ones
    // (qkv after RoPE, att, fc) are read as the forward left them.
    clad::gradient(parallel_layer_forward,
                   "x, ln_w, ln_b, qkv_w, qkv_b, attn_out_w, attn_out_b, fc_w, fc_b, proj_w, proj_b, h, qkv, att, "
                   "fc, act, out")
        .execute(a.x, w.ln1_w, w.ln1_b, w.qkv_w, w.qkv_b, w.attn_out_w, w.attn_out_b, w.fc_w, w.fc_b, w.proj_w,
                 w.proj_b, a.ln1, a.qkv, a.att, a.fc, a.act, a.out, &c, p.d_layer_in, g.ln1_w, g.ln1_b, g.qkv_w,
                 g.qkv_b, g.attn_out_w, g.attn_out_b, g.fc_w, g.fc_b, g.proj_w, g.proj_b, p.d_norm, p.d_qkv, p.d_att,
                 p.d_fc, p.d_act, p.d_res);
    std::memcpy(p.d_res, p.d_layer_in, sizeof(float) * N * d.d_model);
}

// As parallel_layer_pullback_clad, with norm2's weights and output: d_branch holds h2's adjoint.
void zoo::parallel_two_norms_layer_pullback_clad(const LayerCall& c) {
    const Dims& d = *c.d;
    const LayerTensors& w = *c.w;
    LayerTensors& g = *c.g;
    const LayerActs& a = *c.a;
    const ActivationPlan& p = *c.plan;
    const size_t N = c.N();
    expand_saved_bf16(d, a, N);
    for (float* adjoint : {p.d_layer_in, p.d_norm, p.d_branch})
        std::memset(adjoint, 0, sizeof(float) * N * d.d_model);
    std::memset(p.d_qkv, 0, sizeof(float) * N * d.qkv_dim());
    std::memset(p.d_att, 0, sizeof(float) * N * d.attn_dim());
    std::memset(p.d_fc, 0, sizeof(float) * N * d.fc_dim());
    std::memset(p.d_act, 0, sizeof(float) * N * d.d_ff);
    clad::gradient(parallel_two_norms_layer_forward,
                   "x, ln1_w, ln1_b, ln2_w, ln2_b, qkv_w, qkv_b, attn_out_w, attn_out_b, fc_w, fc_b, proj_w, proj_b, "
                   "h, h2, qkv, att, fc, act, out")
        .execute(a.x, w.ln1_w, w.ln1_b, w.ln2_w, w.ln2_b, w.qkv_w, w.qkv_b, w.attn_out_w, w.attn_out_b, w.fc_w,
                 w.fc_b, w.proj_w, w.proj_b, a.ln1, a.ln2, a.qkv, a.att, a.fc, a.act, a.out, &c, p.d_layer_in,
                 g.ln1_w, g.ln1_b, g.ln2_w, g.ln2_b, g.qkv_w, g.qkv_b, g.attn_out_w, g.attn_out_b, g.fc_w, g.fc_b,
                 g.proj_w, g.proj_b, p.d_norm, p.d_branch, p.d_qkv, p.d_att, p.d_fc, p.d_act, p.d_res);
    std::memcpy(p.d_res, p.d_layer_in, sizeof(float) * N * d.d_model);
}
#endif
