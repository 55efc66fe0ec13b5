// The executor: a decoder-only transformer laid out in two arenas, run forward block by block
// and then pulled back in reverse. The layout of parameters is decided in Python
// (zoo/layout.py) and bound here by role; activations are planned here for a (B, T).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "arena.hpp"
#include "blocks/adamw.hpp"
#include "blocks/attention.hpp"
#include "blocks/cross_entropy.hpp"
#include "blocks/embedding.hpp"
#include "blocks/gelu.hpp"
#include "blocks/layernorm.hpp"
#include "blocks/linear.hpp"
#include "blocks/relu2.hpp"
#include "blocks/residual.hpp"
#include "blocks/rmsnorm.hpp"
#include "blocks/rope.hpp"
#include "blocks/swiglu.hpp"

namespace zoo {

enum class NormKind { layernorm, rmsnorm };
enum class MlpKind { gelu, swiglu, relu2 };

struct Dims {
    int vocab_size, max_seq_len, d_model, n_layer, n_head, n_kv_head, head_dim, d_ff;
    NormKind norm;
    MlpKind mlp;
    bool rope;
    float norm_eps;
    bool attention_bias, mlp_bias, tied_embeddings;

    int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim; }
    int attn_dim() const { return n_head * head_dim; }
    int fc_dim() const { return mlp == MlpKind::swiglu ? 2 * d_ff : d_ff; }
};

// Pointers to one layer's tensors (weights, or the matching gradients).
struct LayerWeights {
    float *ln1_w = nullptr, *ln1_b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr;
    float *attn_out_w = nullptr, *attn_out_b = nullptr, *ln2_w = nullptr, *ln2_b = nullptr;
    float *fc_w = nullptr, *fc_b = nullptr, *proj_w = nullptr, *proj_b = nullptr;
};

struct Weights {
    float *wte = nullptr, *wpe = nullptr, *lnf_w = nullptr, *lnf_b = nullptr, *lm_head = nullptr;
    std::vector<LayerWeights> layers;
};

// One layer's saved activations for the pullback.
// ln1, ln2 and act point at buffers shared by all layers (recomputed in the pullback).
struct LayerActs {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *lse, *att, *res_mid;
    float *ln2, *ln2_mean, *ln2_rstd, *fc, *act;
};

// Wall time per block kind, forward and pullback, accumulated while profiling is on.
// The residual adds have no kind: they are fused into the linear layers (Linear::forward).
enum BlockKind { kEmbedding, kNorm, kLinear, kRope, kAttention, kActivation, kCrossEntropy, kAdamW,
                 kBlockKinds };
inline const char* block_kind_name(int k) {
    static const char* names[] = {"embedding",  "norm",          "linear", "rope",
                                  "attention",  "activation",    "cross_entropy", "adamw"};
    return names[k];
}
struct Profile {
    bool on = false;
    double forward[kBlockKinds] = {}, pullback[kBlockKinds] = {};
};

// Which pullback each block uses: the hand-written one or the one Clad generated from the
// block's forward (a Clad build only; zoo.Model(ad=...)). ReLU2 has only the latter.
enum AdBlock { kAdEmbedding, kAdRope, kAdLayerNorm, kAdRMSNorm, kAdGELU, kAdSwiGLU, kAdReLU2, kAdLinear,
               kAdAttention, kAdResidual, kAdCrossEntropy, kAdBlocks };
inline const char* ad_block_name(int k) {
    static const char* names[] = {"embedding", "rope",   "layernorm", "rmsnorm",  "gelu",         "swiglu",
                                  "relu2",     "linear", "attention", "residual", "cross_entropy"};
    return names[k];
}
inline bool has_manual_pullback(int k) { return k != kAdReLU2; }
#ifdef ZOO_CLAD
constexpr bool clad_built = true;
#else
constexpr bool clad_built = false;
#endif
struct AdChoice {
    bool clad[kAdBlocks] = {};
};

// Where every activation buffer of a (B, T) step sits in the activation arena.
struct ActivationPlan {
    float* residual = nullptr;  // (n_layer + 1) x (N, d): each layer's input, then the output
    std::vector<LayerActs> layers;  // with checkpointing, all alias one shared set
    float *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr;
    // One chunk of head rows at a time; it overlaps the buffers below but d_norm, which the
    // head writes (and, with checkpointing, the shared layer internals): dead while it runs.
    float *head_logits = nullptr, *row_loss = nullptr;
    int head_rows = 0;
    // Gradient scratch, shared by all layers.
    float *d_res = nullptr, *d_norm = nullptr, *d_qkv = nullptr, *d_att = nullptr, *d_fc = nullptr,
          *d_act = nullptr, *attn_scratch = nullptr, *norm_scratch = nullptr;
    // Clad pullbacks' scratch (per-thread weight-gradient parts and replay rows), shared by
    // all of them; empty when no block is on Clad.
    float* clad_scratch = nullptr;
};

// Lays out every activation buffer of a (B, T) step from base (nullptr: only count floats
// into pl). A free function so memory can be estimated without building a model.
ActivationPlan layout_activations(const Dims& d, bool checkpointing, ArenaPlanner& pl, float* base,
                                  int B, int T, const AdChoice& ad = AdChoice{});
size_t activation_floats(const Dims& d, bool checkpointing, int B, int T, const AdChoice& ad = AdChoice{});

struct ParamBinding {
    std::string role;
    int layer;
    size_t offset;  // floats into the parameter region
};

class Executor {
public:
    Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& bindings,
             const std::vector<float>& inv_freq);

    const Dims& dims() const { return d_; }
    size_t n_params() const { return n_params_; }
    float* params() { return store_.data; }
    float* grads() { return store_.data + n_params_; }
    float* adam_m() { return store_.data + 2 * n_params_; }
    float* adam_v() { return store_.data + 3 * n_params_; }

    // Lays out the activation arena for batches up to (B, T); no-op when it already fits.
    void plan(int B, int T);
    size_t activation_floats(int B, int T) const { return zoo::activation_floats(d_, checkpointing_, B, T, ad_); }
    // Keep only each layer's input; recompute its internals during the pullback.
    void set_checkpointing(bool on);
    bool checkpointing() const { return checkpointing_; }
    // Blocks (ad_block_name) whose pullback is Clad's; the others use the hand-written one.
    void set_clad_blocks(const std::vector<std::string>& names);
    std::vector<std::string> clad_blocks() const;

    // Forward over tokens (B, T). With targets, returns the mean loss (the head runs chunk by
    // chunk); without, NaN, and the full logits (B*T, V) stay readable until the next call.
    double forward(const int32_t* tokens, const int32_t* targets, int B, int T);
    const float* logits() const { return logits_arena_.data; }
    // One training micro-step: forward, then every pullback in reverse, adding
    // grad_scale * dloss/dparam into the gradient region. Returns the loss.
    double forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T,
                            float grad_scale);
    void zero_grads();

    // Global gradient norm over all parameters. After a forward_backward that wrote the
    // gradients (the first since zero_grads or an optimizer step) it is the norm that
    // pullback took layer by layer; otherwise one pass over the gradients.
    double grad_norm() const;
    // Clips to max_norm (<= 0: no clipping), then AdamW over every tensor range; decay per range.
    double adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                      float max_norm);
    int step_count = 0;
    Profile profile;
    void set_decay_ranges(const std::vector<std::pair<size_t, size_t>>& decayed);  // [begin, end)

    // Generation: KV cache for up to (B, max_len); forward_cached returns last-position logits.
    void reset_cache(int B, int max_len);
    const float* forward_cached(const int32_t* tokens, int B, int T, int pos0);

private:
    Dims d_;
    size_t n_params_;
    Arena store_;  // params | grads | adam m | adam v
    Weights w_, g_;
    std::vector<float> rope_cos_, rope_sin_;
    std::vector<std::pair<size_t, size_t>> decay_ranges_;

    // Activation arena and the plan laid over it.
    Arena acts_;
    bool checkpointing_ = false;
    AdChoice ad_;
    int cap_B_ = 0, cap_T_ = 0, cap_threads_ = 0;
    ActivationPlan a_;
    // True after zero_grads or an optimizer step: the next forward_backward's gradients are
    // the only ones (it writes them, or adds them into zeros, and takes their norm).
    bool grads_consumed_ = true;
    // True after an optimizer step, which zeroes each gradient as it reads it: the next
    // forward_backward adds into the zeros, and its weight-gradient GEMMs run with beta = 1
    // where writing them (beta = 0) costs OpenBLAS a zero-fill pass over every gradient.
    bool grads_zero_ = false;
    bool accumulate_params_ = true;
    Arena logits_arena_;  // full logits, for inference calls only

    // KV cache arena for generation.
    Arena cache_;
    int cache_B_ = 0, cache_len_ = 0;
    float *k_cache_ = nullptr, *v_cache_ = nullptr, *c_x_ = nullptr, *c_norm_ = nullptr,
          *c_stat_ = nullptr, *c_qkv_ = nullptr, *c_probs_ = nullptr, *c_att_ = nullptr,
          *c_fc_ = nullptr, *c_act_ = nullptr, *c_last_ = nullptr, *c_logits_ = nullptr;

    void bind(Weights& w, float* base, const std::vector<ParamBinding>& bindings);
    // Gradient ranges (offset, floats) per layer and outside the layers, and the squared
    // norm the last writing forward_backward summed over them.
    using Range = std::pair<size_t, size_t>;
    std::vector<std::vector<Range>> layer_grad_ranges_;
    std::vector<Range> other_grad_ranges_, all_grads_;
    double grad_sumsq_ = 0.0;
    bool grad_sumsq_valid_ = false;
    size_t role_floats(const std::string& role) const;
    void plan_grad_ranges(const std::vector<ParamBinding>& bindings);
    double grad_sum_squares(const std::vector<Range>& ranges) const;
    void check_ids(const int32_t* tokens, const int32_t* targets, int N) const;
    void trunk_forward(const int32_t* tokens, int B, int T);
    void layer_forward(int i, int B, int T, bool full);
    void layer_pullback(int i, int B, int T);
    double head(const int32_t* targets, int N, bool pullback, float grad_scale);
    void norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                      float* rstd, int N) const;
    void norm_pullback(const float* x, const float* w, const float* b, const float* mean,
                       const float* rstd, const float* dy, float* dx, float* dw, float* db, int N) const;
    void linear_pullback(const Linear& l, const float* x, const float* W, const float* b,
                         const float* dy, float* dx, float* dW, float* db, int N) const;
    void activation_forward(const float* fc, float* act, int N) const;
    void clear_if_writing(float* grad, size_t n) const;
    void activation_pullback(const float* fc, const float* d_act, float* d_fc, int N) const;
    bool mlp_pullback_fused() const;
    void activation_recompute_and_pullback(const float* fc, const float* d_act, float* act, float* d_fc,
                                           int N) const;
    void check_trainable() const;
    const float* head_weight() const { return d_.tied_embeddings ? w_.wte : w_.lm_head; }
    float* head_grad() { return d_.tied_embeddings ? g_.wte : g_.lm_head; }
};

}  // namespace zoo
