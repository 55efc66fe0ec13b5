// The executor: a decoder-only transformer laid out in arenas, run forward block by block and
// pulled back in reverse. The parameter layout comes from Python (zoo/arch/layout.py) as a table of
// (role, layer, offset, count) and is bound in one loop; the blocks come from the registry
// (registry.hpp); activations are planned here by liveness (plan.hpp) for a (B, T).
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/arena.hpp"
#include "blocks/adamw.hpp"
#include "executor/limits.hpp"
#include "executor/plan.hpp"
#include "kernels/quant.hpp"
#include "blocks/registry.hpp"

namespace zoo {

// How a layer arranges its blocks (ModelConfig.layer; the list is in layers.hpp). The executor
// chains every arrangement by hand (layer_forward, layer_pullback); the parallel ones are also
// written as a forward over block calls, whose pullback is Clad's gradient of that forward
// (chaining the blocks' pullbacks, docs/clad.md), taken where ad= puts the arrangement on Clad.
struct LayerCall;  // layers.hpp: what one call of a layer reads and writes
using LayerRun = void (*)(const LayerCall& c);
struct LayerArrangement {
    const char* name;
    bool second_norm;        // a norm of its own before the MLP (ln_2): the layout's and the plan's business
    bool parallel;           // attention and MLP both read the layer's input: x + attn(norm1 x) + mlp(norm2 x)
    LayerRun forward;        // the forward over block calls Clad differentiates; null for sequential
    LayerRun pullback_clad;  // Clad's gradient of forward; null without the Clad backend (or for sequential)
};

struct Dims {
    int vocab_size, max_seq_len, d_model, n_layer, n_head, n_kv_head, head_dim, d_ff;
    const NormBlock* norm;
    const ActivationBlock* mlp;
    const LayerArrangement* layer;
    bool rope;
    float norm_eps;
    bool attention_bias, mlp_bias, tied_embeddings;
    // The options of the Llama variants (ModelConfig; docs/config.md), each off by default.
    bool attention_out_bias = false;  // o_proj's bias (attention_bias is q, k and v's)
    int qk_norm = 0;                  // RMS-normalize q and k after the projection: 0 no, 1 per head, 2 over all heads
    bool pre_norm = true, post_norm = false;  // norms on each branch's input, on its output (before the add)
    std::vector<int> layer_window;    // per layer: keys a query sees (itself included), 0: all before it
    std::vector<char> layer_rope;     // per layer: 0 rotates nothing (NoPE), 1 by the RoPE table, 2 by the local one
    int rotary_dim = 0;               // values of each head that rotate (partial rotary); 0: all
    float attention_softcap = 0.0f;   // scores -> cap tanh(scores / cap) before the softmax (Gemma 2); 0: none
    float logit_softcap = 0.0f;       // logits -> cap tanh(logits / cap) (Gemma 2); 0: none
    float embedding_scale = 1.0f;     // token embeddings times this (Gemma: sqrt(d_model); Granite)
    float residual_scale = 1.0f;      // each branch's output times this before its residual add (Granite)
    float attention_scale = 0.0f;     // the softmax's scale; 0: 1/sqrt(head_dim)
    float logit_scale = 1.0f;         // logits times this (Granite: 1 / logits_scaling)
    // The run's setup beside the architecture (zoo/arch/lora.py): a frozen base (a LoRA run, or a
    // model that only runs forward) with its matrices in matrix_dtype, and the adapters' widest
    // stack (segments x rank) and whether they drop their input: these size the scratch.
    bool frozen = false;
    DType matrix_dtype = DType::f32;
    int lora_width = 0;        // 0: no adapters
    float lora_scale = 1.0f;   // alpha / rank
    float lora_dropout = 0.0f;
    uint64_t lora_seed = 0;    // the dropout masks', with the optimizer step and the pass

    // ints: check_dims keeps them within limits::max_row_floats.
    int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim; }
    int attn_dim() const { return n_head * head_dim; }
    int fc_dim() const { return mlp->gate_width * d_ff; }
    int widest_input() const { return std::max({d_model, attn_dim(), d_ff}); }
    int widest_output() const { return std::max({qkv_dim(), d_model, fc_dim()}); }
    int qk_dim() const { return (n_head + n_kv_head) * head_dim; }  // the q|k prefix of a qkv row
    int rotary_half() const { return (rotary_dim ? rotary_dim : head_dim) / 2; }
    // The branch output goes through a buffer of its own (not fused into the residual add).
    bool branch_buffer() const { return post_norm || residual_scale != 1.0f; }
    // The options the fused decode step and the Clad-chained layers do not compute (partial rotary they do).
    bool variant() const {
        if (qk_norm || !pre_norm || branch_buffer() || attention_scale != 0.0f || embedding_scale != 1.0f ||
            attention_softcap != 0.0f)
            return true;
        for (int w : layer_window) if (w) return true;
        for (char r : layer_rope) if (r != 1) return true;
        return false;
    }
    // The options the fused decode step computes (decode.cpp) besides the plain layer's: q/k norms
    // per head, windows (ring caches), NoPE and local-RoPE layers, the embedding and attention
    // scales and the score soft-cap. Not: q/k norms over all heads, norms on branch outputs or
    // none on their inputs, the residual scale (a branch through a buffer of its own).
    bool fused_decode_options() const { return qk_norm != 2 && pre_norm && !branch_buffer(); }
    float softmax_scale() const { return attention_scale != 0.0f ? attention_scale : 1.0f / std::sqrt((float)head_dim); }
};

// Throws std::invalid_argument, naming the field or product, if a size of d is outside the
// bounds of limits.hpp (or the heads do not group): before anything is sized from d.
inline void check_dims(const Dims& d) {
    using namespace limits;
    check_size("n_layer", d.n_layer, max_layers);
    check_size("d_model", d.d_model, max_width);
    check_size("n_head", d.n_head, max_width);
    check_size("n_kv_head", d.n_kv_head, max_width);
    check_size("head_dim", d.head_dim, max_width);
    check_size("d_ff", d.d_ff, max_width);
    check_size("vocab_size", d.vocab_size, max_vocab);
    check_size("max_seq_len", d.max_seq_len, max_seq_len);
    if (d.n_head % d.n_kv_head != 0)
        throw std::invalid_argument("zoo: n_head = " + std::to_string(d.n_head) + " is not a multiple of n_kv_head = " +
                                    std::to_string(d.n_kv_head));
    const int64_t D = d.d_model, qkv = (int64_t(d.n_head) + 2 * int64_t(d.n_kv_head)) * d.head_dim,
                  fc = int64_t(d.mlp->gate_width) * d.d_ff;
    check_size("(n_head + 2 n_kv_head) x head_dim", qkv, max_row_floats);
    check_size("gate width x d_ff", fc, max_row_floats);
    check_size("vocab_size x d_model", int64_t(d.vocab_size) * D, max_tensor_floats);
    check_size("max_seq_len x d_model", int64_t(d.max_seq_len) * D, max_tensor_floats);
    check_size("(n_head + 2 n_kv_head) x head_dim x d_model", qkv * D, max_tensor_floats);
    check_size("gate width x d_ff x d_model", fc * D, max_tensor_floats);
}

// The roles a parameter binds to: the names zoo/arch/layout.py gives them. Each becomes a pointer
// field of the structs below, and the binding loop matches role names against this one list.
#define ZOO_MODEL_ROLES(X) X(wte) X(wpe) X(lnf_w) X(lnf_b) X(lm_head_w)
#define ZOO_LAYER_ROLES(X)                                                                       \
    X(ln1_w) X(ln1_b) X(qkv_w) X(qkv_b) X(q_norm_w) X(k_norm_w) X(attn_out_w) X(attn_out_b) X(post_attn_w) \
        X(post_attn_b) X(ln2_w) X(ln2_b) X(fc_w) X(fc_b) X(proj_w) X(proj_b) X(post_mlp_w) X(post_mlp_b)
#define ZOO_POINTER_FIELD(role) float* role = nullptr;
// The roles whose tensors feed matrix products (and the token embedding's lookups): a frozen
// base may store them in a narrower format (quant.hpp). Each is also a Matrix field below.
#define ZOO_MODEL_MATRICES(X) X(wte) X(lm_head_w)
#define ZOO_LAYER_MATRICES(X) X(qkv_w) X(attn_out_w) X(fc_w) X(proj_w)
#define ZOO_MATRIX_FIELD(role) Matrix role;

// One layer's tensors (weights, or the matching gradients).
struct LayerTensors {
    ZOO_LAYER_ROLES(ZOO_POINTER_FIELD)
};
struct ModelTensors {
    ZOO_MODEL_ROLES(ZOO_POINTER_FIELD)
    std::vector<LayerTensors> layers;
};
// The weights' matrices as the products read them: views of the trainable fp32 weights, or of
// the frozen base in its format.
struct LayerMatrices {
    ZOO_LAYER_MATRICES(ZOO_MATRIX_FIELD)
};
struct ModelMatrices {
    ZOO_MODEL_MATRICES(ZOO_MATRIX_FIELD)
    std::vector<LayerMatrices> layers;
};

// One row of the layout table: the tensor bound to role (in layer, or -1 outside the layers)
// is count floats at offset. Fused tensors (q|k|v, gate|up) are one row.
struct ParamBinding {
    std::string role;
    int layer;
    size_t offset, count;
};
// A frozen base's tensor, in the base arena in table order: rows x cols values in dtype (a
// vector of n is n rows of 1; a fused tensor's parts are consecutive rows).
struct FrozenBinding {
    std::string role;
    int layer;
    size_t rows, cols;
    DType dtype;
};
// The layers' linear layers an adapter can sit on.
#define ZOO_LORA_SLOTS(X) X(qkv) X(attn_out) X(fc) X(proj)
enum LoraSlot {
#define ZOO_ENUM_LORA_SLOT(s) lora_##s,
    ZOO_LORA_SLOTS(ZOO_ENUM_LORA_SLOT) kLoraSlots
};
// One adapter (lora.hpp): on slot of layer, output columns [o0, o1), A (rank, in) at a_offset
// and B (o1 - o0, rank) at b_offset in the trainable arena. A slot's adapters, in order of o0,
// have their A's adjacent and their B's adjacent.
struct AdapterBinding {
    std::string slot;
    int layer, o0, o1, rank;
    size_t a_offset, b_offset;
};
// A slot's adapters as the kernels take them.
struct SlotAdapters {
    int n_seg = 0, rank = 0;
    std::vector<int> seg;  // (o0, o1) pairs
    float *A = nullptr, *B = nullptr, *dA = nullptr, *dB = nullptr;
    size_t a_offset = 0, b_offset = 0;  // where the A's and the B's start in the trainable arena
};

// What one layer reads and writes. Training: x is the layer's input in the residual stream,
// out the next layer's, the internals are the layer's saved buffers (the norm outputs and the
// activation output shared by all layers, recomputed in the pullback). In a bf16 step qkv, att
// and fc are fp32 buffers all layers share, and each layer keeps them in bf16 (the *_bf16
// pointers, null otherwise; bf16.hpp). Generation: x, res_mid and out are one buffer, the
// residual stream updated in place.
struct LayerActs {
    const float* x;  // (a parallel layer adds both branches into out: res_mid unused; with one norm, ln2 too)
    float *ln1, *ln1_stats, *qkv, *lse, *att, *res_mid, *ln2, *ln2_stats, *fc, *act, *out;
    uint16_t *qkv_bf16 = nullptr, *att_bf16 = nullptr, *fc_bf16 = nullptr;
    // The variants' (Dims): q and k before their norm, as [all q rows | all k rows], with the
    // norm's statistics, and the normalized ones before they go back into qkv; each branch's
    // output before its add (with its post-norm statistics), and the post-norm output.
    float *qk_raw = nullptr, *qk_stats = nullptr, *qk_work = nullptr;
    float *attn_branch = nullptr, *attn_branch_stats = nullptr, *mlp_branch = nullptr, *mlp_branch_stats = nullptr,
          *post_out = nullptr;
    // Where a frozen base's products widen its matrices, and the adapters' scratch.
    float *matrix_scratch = nullptr, *lora_scratch = nullptr;
    // The adapters' h = scale x A^T of each slot (N x lora_width floats a slot), kept from the
    // forward (or a checkpointed layer's recompute) for the pullback, which would recompute it.
    float* lora_h = nullptr;
};

// Where every activation buffer of a (B, T) step sits in the activation arena.
struct ActivationPlan {
    float* residual = nullptr;      // (n_layer + 1) x (N, d): each layer's input, then the output
    std::vector<LayerActs> layers;  // with checkpointing, the internals alias one shared set
    float *lnf = nullptr, *lnf_stats = nullptr;
    float *head_logits = nullptr, *row_loss = nullptr;  // one chunk of head rows at a time
    float* head_tanh = nullptr;  // the logit soft cap's tanh over that chunk (Dims::logit_softcap)
    int head_rows = 0;
    // Adjoints, shared by all layers.
    float *d_res = nullptr, *d_norm = nullptr, *d_qkv = nullptr, *d_att = nullptr, *d_fc = nullptr,
          *d_act = nullptr;
    float* d_layer_in = nullptr;  // a Clad-chained layer's input adjoint (its seed, d_res, must not alias it)
    float* d_qk = nullptr;        // q|k norm: the output's adjoint gathered, then the input's (2 x N x qk_dim)
    float* d_branch = nullptr;    // a branch output's adjoint (through its post-norm and residual scale)
    float* attention_scratch = nullptr;  // the attention forward's
    float* pullback_scratch = nullptr;   // the largest need of the model's pullbacks (one runs at a time)
    float* head_scratch = nullptr;       // the cross-entropy pullback's
    float* matrix_scratch = nullptr;     // a frozen base's products (every phase)
    size_t matrix_scratch_floats = 0;    // its size
    float* lora_scratch = nullptr;       // the adapters' (forward and pullback)
    uint16_t* lora_rounded = nullptr;    // its end: a segment's B and h in bf16 (Lora::round_small)
    size_t lora_rounded_values = 0;
    std::vector<PlannedBuffer> buffers;  // the plan itself, for tests and memory reports
};

// Which blocks take Clad's pullback (zoo.Model(ad=...)); the others the hand-written one.
struct AdChoice {
    std::set<std::string> clad;
    bool on(const char* block) const { return clad.count(block) > 0; }
};
// The choice for a model: the blocks named (each must have a Clad pullback in this build), and
// the model's norm or activation where Clad's pullback is its only one.
AdChoice ad_choice(const Dims& d, const std::vector<std::string>& clad_blocks);

// The model's pullbacks, picked from the registry by the AD choice (Executor::set_clad_blocks). A null
// one is a block with no pullback in this build: check_trainable names it.
struct Pullbacks {
    NormPullback norm = nullptr;
    ActivationPullback activation = nullptr;
    // The same with the recompute of the activation's output in one pass (the MLP pullback of a
    // trainable base); from the same backend as activation.
    ActivationRecomputePullback activation_fused = nullptr;
    LinearPullback linear = nullptr;
    AttentionPullback attention = nullptr;
    RopePullback rope = nullptr;
    EmbeddingPullback embedding = nullptr;
    CrossEntropyPullback cross_entropy = nullptr;
    LoraPullback lora = nullptr;
    LayerRun layer = nullptr;  // a layer arrangement's (Clad's chaining); null for the sequential layer
};

// Which pass a layer call is: training, the recompute before a checkpointed pullback (which
// stops before the projections into the residual stream), generation against the KV cache, or
// the forward sweep of a Clad-chained layer pullback (replay: only what the pullback reads from
// buffers all layers share is recomputed; layers.hpp).
enum class LayerPass { train, recompute, cached, replay };

// The gradient region's lifecycle, with its transitions in one place. fresh: zero_grads was
// called, the next pass writes the gradients (no clearing pass, and no GEMM reads old ones);
// consumed: AdamW zeroed each gradient as it read it, the next pass adds into the zeros (the
// weight-gradient GEMMs then run with beta 1, sparing the BLAS a zero-fill pass); accumulating:
// a pass ran since, the next one adds. After a fresh or consumed state the pass's gradients are
// the only ones, and it takes their squared norm on the way (for clipping).
struct GradLifecycle {
    enum State { fresh, consumed, accumulating } state = fresh;
    double sumsq = 0.0;  // valid while norm_valid
    bool norm_valid = false;

    GradMode pass_mode() const { return state == fresh ? GradMode::write : GradMode::add; }
    bool pass_is_first() const { return state != accumulating; }
    void begin_pass() {
        state = accumulating;
        norm_valid = false;
    }
    void end_first_pass(double sum_of_squares) {
        sumsq = sum_of_squares;
        norm_valid = true;
    }
    void zero_grads() {  // consumed gradients are zeros already: keep adding into them
        if (state == accumulating) state = fresh;
        norm_valid = false;
    }
    // all: AdamW read (and zeroed) every gradient. A step over one shard of them (ZeRO-1)
    // leaves the others as they were: the next pass writes instead of adding.
    void optimizer_step(bool all) {
        state = all ? consumed : fresh;
        norm_valid = false;
    }
    void written_outside() { norm_valid = false; }  // a collective rewrote them (the norm is stale)
};

// Wall time per block kind, forward and pullback, accumulated while profiling is on. The
// residual adds have no slot: they are fused into the linear layers. The LM head's products have
// their own (lm_head), apart from the layers' linear ones: over a large vocabulary they are a
// quarter of a LoRA step's products (docs/benchmarks.md).
#define ZOO_PROFILE_SLOTS(X)                                                                              \
    X(embedding) X(norm) X(linear) X(lora) X(rope) X(attention) X(activation) X(lm_head) X(cross_entropy) \
    X(adamw)
enum ProfileSlot {
#define ZOO_ENUM_SLOT(s) k_##s,
    ZOO_PROFILE_SLOTS(ZOO_ENUM_SLOT) kProfileSlots
};
struct Profile {
    bool on = false;
    double forward[kProfileSlots] = {}, pullback[kProfileSlots] = {};
    // Seconds on a monotonic clock since its first reading. (omp_get_wtime() of LLVM's OpenMP,
    // which a Clad build links, ticks in whole microseconds: a tiny model's embedding pullback
    // read 0, and bench_ad's test failed now and then.)
    static double now() {
        static const auto start = std::chrono::steady_clock::now();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
};

// Lays out every activation buffer of a (B, T) training step from base (nullptr: only plan).
// A free function so memory can be estimated without building a model.
ActivationPlan plan_activations(const Dims& d, int ckpt_layers, Precision precision, const AdChoice& ad, int B,
                                int T, float* base, size_t* total_floats);
size_t activation_floats(const Dims& d, int ckpt_layers, Precision precision, int B, int T, const AdChoice& ad);
// The generation arena (KV cache and buffers) for up to (B, max_len): what reset_cache maps.
// A call's rows go through the layers at most this many at a time (prompts are chunked).
constexpr int cache_chunk_rows = 512;
size_t cache_floats(const Dims& d, int B, int max_len);
// Each thread's scratch in the fused decode step (decode.cpp).
size_t decode_thread_floats(const Dims& d);

class Executor {
public:
    // layout: the trainable tensors (the whole model, or a LoRA run's adapters), n_params
    // floats. frozen: a frozen base's tensors (none when the base trains; d.frozen says which).
    // adapters: the LoRA adapters among the trainable tensors.
    // inv_freq: RoPE's frequencies (rotary_dim / 2 of them); inv_freq_local: those of the local
    // layers' table (Dims::layer_rope 2), or none.
    Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& layout,
             const std::vector<FrozenBinding>& frozen, const std::vector<AdapterBinding>& adapters,
             const std::vector<float>& inv_freq, const std::vector<float>& inv_freq_local = {});

    const Dims& dims() const { return d_; }
    size_t n_params() const { return n_params_; }
    float* params() { return params_.data; }
    // The gradients' arena is mapped at its first use: a model that only runs forward has none.
    float* grads();
    bool has_grads() const { return grads_arena_.data != nullptr; }

    // The frozen base: its tensors in table order, stored and read back as fp32 rows.
    size_t base_tensors() const { return base_rows_.size(); }
    void store_base(size_t index, size_t first_row, size_t rows, const float* values);
    void load_base(size_t index, size_t first_row, size_t rows, float* values) const;
    const FrozenBinding& base_binding(size_t index) const;
    // The frozen matrix index (fp32 or bf16: a file's own formats) read from bytes [offset, ...)
    // of a file, mapped (FileMapping), instead of its place in the base arena: its rows cost
    // memory only where a pass reads them (a token embedding the head does not share). what
    // names the tensor in errors. Replaces what was stored there; later stores stay private.
    void map_base(size_t index, const std::string& path, size_t offset, const std::string& what);
    // Bytes of the frozen base mapped from files.
    size_t mapped_base_bytes() const;
    // A second copy of a bf16 frozen base's matrices (the layers' and the LM head's), packed for
    // their input gradients (gemm::pack_xw), in an arena of its own: a bf16 step's pullback then
    // runs its products at the kernels' rate, for that much more memory. Where this CPU has no
    // packed layout, or the base no bf16 matrix, nothing is packed. Returns the bytes packed.
    // A packed matrix stored into or mapped again is packed again before the next pass reads it.
    size_t set_packed_base(bool on);
    size_t packed_base_bytes();  // what set_packed_base(true) packs
    bool packed_base() const { return packed_on_; }
    // Bytes each arena holds now (weights, frozen base, its packed copy, gradients, moments,
    // activations, KV cache, logits).
    std::vector<std::pair<std::string, size_t>> arena_bytes() const;
    // AdamW's moments, for the parameters [moment_begin, moment_end) only: all of them, or one
    // rank's shard under ZeRO-1 (docs/distributed.md). Mapped at their first use, in their own
    // arena sized to the range, so a shard costs 8 bytes per parameter of the shard alone.
    float* adam_m() { return moments().data; }
    float* adam_v() { return moments().data + moment_floats(); }
    size_t moment_begin() const { return moment_begin_; }
    size_t moment_end() const { return moment_end_; }
    size_t moment_floats() const { return moment_end_ - moment_begin_; }
    // The range the moments (and so adamw_step) cover; only before the moments are first used.
    void set_moment_range(size_t begin, size_t end);

    // Lays out the activation arena for batches up to (B, T); no-op when it already fits.
    void plan(int B, int T);
    size_t activation_floats(int B, int T) const {
        return zoo::activation_floats(d_, ckpt_layers_, precision_, B, T, ad_);
    }
    const ActivationPlan& activation_plan() const { return a_; }
    // A test of the plan's live phases: at each phase boundary of a step, fill the activation
    // memory no buffer live in the next phase covers with NaN. A buffer read in a phase its
    // declaration leaves out then turns the results into NaN.
    void set_poison_dead_buffers(bool on) { poison_dead_ = on; }
    // Keep only each layer's input; recompute its internals during the pullback.
    void set_checkpointing(bool on) { set_checkpoint_layers(on ? d_.n_layer : 0); }
    bool checkpointing() const { return ckpt_layers_ > 0; }
    // The first `layers` layers checkpointed (0 to n_layer): activation checkpointing of part of the model.
    void set_checkpoint_layers(int layers);
    int checkpoint_layers() const { return ckpt_layers_; }
    // The precision of every matrix product (gemm.hpp); the rest of the step stays fp32:
    // weights, gradients, AdamW moments, norms, softmax, cross-entropy and the residual stream.
    void set_precision(Precision p);
    Precision precision() const { return precision_; }
    // Blocks (by registry name) whose pullback is Clad's; the others use the hand-written one.
    void set_clad_blocks(const std::vector<std::string>& names);
    std::vector<std::string> clad_blocks() const { return {ad_.clad.begin(), ad_.clad.end()}; }

    // Forward over tokens (B, T). With targets, returns the mean loss (the head runs chunk by
    // chunk); without, NaN, and the full logits (B*T, V) stay readable until the next call.
    // positions (B, T), may be null: each token's position in its example, for rows that pack
    // several examples (each restarting at 0; attention stays within an example). Null: 0..T-1.
    // hidden (B, T, 2), may be null (and needs positions): a span of keys each row does not see
    // (block.hpp's visible_keys: a preference pair's second answer does not see the first).
    double forward(const int32_t* tokens, const int32_t* targets, const int32_t* positions, const int32_t* hidden,
                   int B, int T);
    const float* logits() const { return logits_arena_.data; }
    size_t logits_floats() const { return logits_arena_.size; }
    // One training micro-step: forward, then every pullback in reverse, the gradients written
    // or added as the lifecycle says, scaled by grad_scale. Returns the loss.
    double forward_backward(const int32_t* tokens, const int32_t* targets, const int32_t* positions,
                            const int32_t* hidden, int B, int T, float grad_scale);
    void zero_grads() { grads_.zero_grads(); }

    // A preference step's two halves (zoo/train/preference_step.py), whose loss is a function of
    // sums of target log-probabilities. select_forward runs the forward over tokens (B, T) and
    // the LM head over the selected rows alone (rows: n increasing indices into the B*T rows,
    // targets: theirs), writing each one's cross-entropy, minus its log-probability, into
    // row_loss (n). With train, it keeps what select_backward needs: that call (next, with no
    // other pass between) runs the pullback with dL/d(row_loss[k]) = grad_scale * row_weight[k]
    // (k < n), the gradients written or added as forward_backward's are.
    void select_forward(const int32_t* tokens, const int32_t* positions, const int32_t* hidden, const int32_t* rows,
                        const int32_t* targets, int n, int B, int T, bool train, float* row_loss);
    void select_backward(const float* row_weight, float grad_scale);
    // Off: the LoRA adapters add nothing (the frozen base alone: a preference objective's
    // reference model); training passes need them on.
    void set_adapters_enabled(bool on) { adapters_on_ = on; }
    bool adapters_enabled() const { return adapters_on_; }

    // Global gradient norm: the one the last first pass took, or one pass over the gradients.
    double grad_norm() const;
    // Sum of squares of the gradients [begin, end): one rank's part of a global norm.
    double grad_sum_squares(size_t begin, size_t end) const;
    // After a collective rewrote the gradients in place: the norm the pass took is stale.
    void grads_written_outside() { grads_.written_outside(); }
    // Clips to max_norm (<= 0: no clipping) by the global norm `norm` (< 0: grad_norm()), then
    // AdamW over the parameters of the moment range; decay per range. Returns the norm.
    double adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay, float max_norm,
                      double norm = -1.0);
    int step_count = 0;
    Profile profile;
    void set_decay_ranges(const std::vector<std::pair<size_t, size_t>>& decayed);  // [begin, end)

    // Generation: a KV cache of B sequences (its slots) of up to max_len tokens each, empty.
    void reset_cache(int B, int max_len);
    size_t cache_floats(int B, int max_len) const;  // what reset_cache(B, max_len) allocates
    int cache_slots() const { return cache_B_; }
    int cache_length() const { return cache_len_; }
    int slot_length(int slot) const;  // positions of the slot the cache holds
    // Runs S segments through the cache: segment s is lengths[s] tokens (the next ones of
    // tokens) of slot slots[s] at positions starts[s].., each slot at most once, each start at
    // most what the slot holds (the positions before it are in the cache; those from it on are
    // replaced). Returns the logits of each segment's last token, (S, V), valid until the next
    // call. A few rows at a time (new tokens) take the decode kernels (gemv.hpp); prompts go
    // through the GEMM path in chunks of at most cache_chunk_rows rows.
    const float* forward_segments(const int32_t* tokens, const int32_t* slots, const int32_t* starts,
                                  const int32_t* lengths, int S);
    // Every slot, T tokens each from pos0: (B, T) tokens; the logits of each slot's last token.
    const float* forward_cached(const int32_t* tokens, int B, int T, int pos0);

private:
    Dims d_;
    size_t n_params_;
    Arena params_;       // the trainable tensors
    Arena grads_arena_;  // their gradients, mapped at the first pass that needs them
    Arena base_;         // a frozen base, in its formats (bytes, counted in floats)
    std::vector<FrozenBinding> base_rows_;
    std::vector<size_t> base_offsets_;  // bytes
    std::vector<std::unique_ptr<FileMapping>> base_files_;  // per base tensor: its file's bytes, or null
    Arena packed_;  // set_packed_base's copy (bytes, counted in floats)
    bool packed_on_ = false, packed_stale_ = false;
    std::vector<Matrix*> packable_matrices();
    void repack_base();
    uint8_t* base_data(size_t index) const {
        return base_files_[index] ? base_files_[index]->data
                                  : reinterpret_cast<uint8_t*>(base_.data) + base_offsets_[index];
    }
    std::vector<std::array<SlotAdapters, kLoraSlots>> adapters_;
    int passes_since_step_ = 0;  // the forward_backward calls since the last optimizer step
    mutable std::vector<float> frozen_grad_sink_;  // where the norms' pullbacks put a frozen base's dw, db
    bool dropout_on_ = false;                      // during forward_backward: the adapters drop their input
    ModelMatrices wm_;
    std::vector<ParamBinding> layout_;
    Arena moments_;  // adam m | adam v over [moment_begin_, moment_end_), mapped at first use
    size_t moment_begin_ = 0, moment_end_ = 0;
    Arena& moments();
    ModelTensors w_, g_;
    std::vector<float> rope_cos_, rope_sin_, local_cos_, local_sin_;
    std::vector<float> rope_inv_freq_, local_inv_freq_;
    int rope_len_ = 0;  // positions the tables hold
    void ensure_rope(int len);
    // Layer i's RoPE tables, and whether it rotates at all.
    const float* rope_cos(int i) const { return d_.layer_rope[i] == 2 ? local_cos_.data() : rope_cos_.data(); }
    const float* rope_sin(int i) const { return d_.layer_rope[i] == 2 ? local_sin_.data() : rope_sin_.data(); }
    RoPE rope() const { return RoPE{d_.head_dim, d_.rotary_dim}; }
    std::vector<std::pair<size_t, size_t>> decay_ranges_;
    using Range = std::pair<size_t, size_t>;  // (offset, floats)
    std::vector<std::vector<Range>> layer_grad_ranges_;  // per layer, adjacent ones merged
    std::vector<Range> other_grad_ranges_, all_grads_;

    Arena acts_;
    int ckpt_layers_ = 0;  // layers 0 .. ckpt_layers_ - 1 recomputed in the pullback
    // Which layer's forward, in which trunk pass, last wrote each slot's kept h of each set of
    // internals (the recomputed layers share set 0, and their recompute skips some slots): the
    // pullback reads h only where it is its own layer's of this pass.
    uint64_t trunk_passes_ = 0;
    std::vector<std::array<uint64_t, kLoraSlots>> h_from_;
    size_t internals_set(int i) const { return i < ckpt_layers_ ? 0 : (size_t)i; }
    uint64_t h_key(int i) const { return trunk_passes_ * 65536 + (uint64_t)i + 1; }
    Precision precision_ = Precision::fp32;
    AdChoice ad_;
    Pullbacks pb_;
    int cap_B_ = 0, cap_T_ = 0, cap_threads_ = 0;
    ActivationPlan a_;
    bool poison_dead_ = false;
    GradLifecycle grads_;
    const int32_t* positions_ = nullptr;  // the running forward's (B, T) positions; null: 0..T-1
    const int32_t* hidden_ = nullptr;     // and its rows' hidden key spans (B, T, 2); null: none
    bool adapters_on_ = true;
    // What a training select_forward keeps for its select_backward (copies: the caller's arrays
    // need not outlive the call; they grow with the largest batch, like the plan).
    struct Selection {
        std::vector<int32_t> tokens, positions, hidden, rows, targets;
        int B = 0, T = 0, n = 0;
        bool pending = false;  // a training select_forward ran and no other pass since
        bool head_adjoint = false;  // it left the head's input adjoint of the unweighted rows in d_norm
    } sel_;
    Arena logits_arena_;  // full logits, for inference calls only

    // KV cache arena for generation, and the running call's chunk: its rows' positions and runs.
    Arena cache_;
    int cache_B_ = 0, cache_len_ = 0, cache_rows_ = 0, cache_threads_ = 0;
    std::vector<int> cache_cap_;        // per layer: positions its cache holds per slot (a ring with a window)
    std::vector<size_t> cache_offset_;  // per layer: where its keys (and values) start in k_cache_ (v_cache_)
    float *k_cache_ = nullptr, *v_cache_ = nullptr, *c_last_ = nullptr, *c_logits_ = nullptr;
    float *c_attention_scratch_ = nullptr, *c_decode_scratch_ = nullptr;
    LayerActs cached_;  // the generation pass's buffers, the same for every layer
    // (All sized by reset_cache: a call allocates nothing.)
    std::vector<int32_t> slot_len_, slot_seen_, chunk_tokens_, chunk_positions_;
    std::vector<int32_t> all_slots_, all_starts_, all_lengths_;  // forward_cached's segments
    std::vector<CacheRun> chunk_runs_;
    std::vector<std::pair<int, int>> chunk_ends_;  // (segment, row) of the segments a chunk ends
    int chunk_n_runs_ = 0;
    void cached_chunk(int rows);  // the layers over the chunk's rows, one block call at a time
    // The same in one parallel region (decode.cpp), where fused_decode(rows) says it applies.
    bool fused_decode(int rows) const;
    void decode_chunk(int rows);
public:
    // Whether a call of `rows` new rows takes the fused decode step (tests).
    bool decodes_fused(int rows) const { return fused_decode(rows); }
private:
    std::unique_ptr<std::atomic<int>[]> decode_next_;  // each layer's four products' chunk counters
    bool has_adapters_ = false;
    // A linear layer's forward: in generation (cached), a few rows on the decode kernels.
    void linear_forward(const Linear& l, bool cached, const float* x, const Matrix& W, const float* b, float* y,
                        int N, const float* residual, float* scratch);

    void bind(ModelTensors& t, float* base, const std::vector<ParamBinding>& layout) const;
    void bind_frozen(const std::vector<FrozenBinding>& frozen);
    void bind_matrices();
    void bind_adapters(const std::vector<AdapterBinding>& adapters);
    void point_adapters();  // A, B (and dA, dB once the gradients are mapped) from the offsets
    void plan_grad_ranges(const std::vector<ParamBinding>& layout, const std::vector<AdapterBinding>& adapters);
    // A linear layer's pullback: dx always, dW and db where the base trains; then the slot's
    // adapters (dx added). x: the layer's input.
    void linear_pullback(int i, LoraSlot slot, const Linear& l, const float* x, const float* W, const Matrix& Wm,
                         const float* b, const float* dy, float* dx, float* dW, float* db, int N, GradMode mode,
                         const LayerActs& a);
    void adapted_forward(int i, LoraSlot slot, const Linear& l, bool cached, const float* x, const Matrix& W,
                         const float* b, float* y, int N, const float* residual, const LayerActs& a);
    void adapter_forward(int i, LoraSlot slot, const float* x, float* y, int N, const LayerActs& a,
                         bool write = false);
    Lora pullback_lora(LoraSlot slot, const SlotAdapters& s, const LayerActs& a) const;
    float* slot_h(const LayerActs& a, LoraSlot slot, int N) const;
    void note_h(int i, LoraSlot slot, const LayerActs& a);
    void adapter_pullback(int i, LoraSlot slot, const float* x, const float* dy, float* dx, int N, GradMode mode,
                          const LayerActs& a);
    uint64_t dropout_seed(int i, LoraSlot slot) const;
    double grad_sum_squares(const std::vector<Range>& ranges) const;
    void check_ids(const int32_t* tokens, const int32_t* targets, int N) const;
    void check_selection(const int32_t* rows, const int32_t* targets, int n, int N) const;
    void check_trainable() const;
    void poison_dead_buffers(unsigned phase);
    void trunk_forward(const int32_t* tokens, int B, int T);
    // From the LM head's input adjoint (a_.d_norm) back through every layer and the embedding.
    void trunk_pullback(const int32_t* tokens, int B, int T, GradMode mode, bool first);
    // The LM head over lnf's first n rows (the selected rows, moved there): their cross-entropy
    // into row_loss; with adjoint, the pullback too, into d_norm's first n rows (executor.cpp).
    void head_selected(const int32_t* targets, int n, float* row_loss, bool adjoint, const float* row_weight,
                       float grad_scale, GradMode mode);
    // The layer, written once: training, the recompute before a checkpointed pullback (which
    // stops before the output projection), and generation against the KV cache from pos0.
    void layer_forward(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0 = 0);
    void layer_pullback(int i, int B, int T, GradMode mode);
    // A layer arrangement's call (layers.hpp): layer i's weights, gradients, buffers and pass.
    LayerCall layer_call(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0, GradMode mode);
    double head(const int32_t* targets, int N, bool pullback, float grad_scale, GradMode mode);
    void finish_logits(float* z, size_t n, float* t) const;
    void logits_pullback(float* dz, const float* t, size_t n) const;
    void norm_forward(const float* x, const float* w, const float* b, float* y, float* stats, int N,
                      int C = 0) const;  // C: the row width, 0 for d_model
    // y: null, or where the norm's output is recomputed (NormPullback).
    void norm_pullback(const float* x, const float* w, const float* b, float* stats, const float* dy, float* y,
                       float* dx, float* dw, float* db, int N, GradMode mode, int C = 0) const;
    // The variants' steps of the sequential layer (Dims): q|k norm and its pullback on qkv
    // (d_qkv) in place; a branch's output (y) into the residual stream r (out = r + scale
    // post_norm(y)), and the adjoint of y from the output's.
    void parallel_pullback(int i, int B, int T, GradMode mode);  // layer_pullback's parallel arrangements
    void qk_norm_forward(int i, const LayerActs& a, int N);
    void qk_norm_pullback(int i, const LayerActs& a, int N, GradMode mode);
    void branch_add(const float* y, const float* post_w, const float* post_b, float* stats, float* post_out,
                    const float* r, float* out, int N);
    const float* branch_pullback(const float* y, const float* post_w, const float* post_b, float* stats, float* d_post_w,
                                 float* d_post_b, int N, GradMode mode);
    Attention attention(int i) const {
        return Attention{d_.n_head, d_.n_kv_head, d_.head_dim, d_.layer_window[i], d_.softmax_scale(),
                         d_.attention_softcap};
    }
    bool layer_rotates(int i) const { return d_.rope && d_.layer_rope[i]; }
    const float* head_weight() const { return d_.tied_embeddings ? w_.wte : w_.lm_head_w; }
    const Matrix& head_matrix() const { return d_.tied_embeddings ? wm_.wte : wm_.lm_head_w; }
    float* head_grad() { return d_.tied_embeddings ? g_.wte : g_.lm_head_w; }
    Linear linear(int in, int out) const { return Linear{in, out, precision_}; }
};

}  // namespace zoo
