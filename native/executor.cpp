#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16.hpp"
#include "layers.hpp"

namespace zoo {

// Runs the statement, adding its wall time to profile.<dir>[k_<slot>] when profiling is on.
#define TIMED(dir, slot, ...)                                         \
    do {                                                               \
        double t0_ = profile.on ? omp_get_wtime() : 0.0;               \
        __VA_ARGS__;                                                   \
        if (profile.on) profile.dir[k_##slot] += omp_get_wtime() - t0_; \
    } while (0)

Executor::Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& layout,
                   const std::vector<float>& inv_freq)
    : d_(dims), n_params_(n_params) {
    check_dims(d_);            // before any table is sized from the config
    plan_grad_ranges(layout);  // checks the table before anything is bound
    store_.reset(2 * n_params_, "parameter arena (weights and gradients)");
    moment_end_ = n_params_;
    bind(w_, params(), layout);
    bind(g_, grads(), layout);
    if (d_.rope) {
        if ((int)inv_freq.size() != d_.head_dim / 2)
            throw std::invalid_argument("zoo: inv_freq must have head_dim/2 entries");
        size_t n = (size_t)d_.max_seq_len * d_.head_dim / 2;
        rope_cos_.resize(n);
        rope_sin_.resize(n);
        RoPE{d_.head_dim}.build_tables(inv_freq.data(), rope_cos_.data(), rope_sin_.data(), d_.max_seq_len);
    }
    set_clad_blocks({});
}

// The table must tile the parameter arena exactly (no gap: a gradient no pullback writes; no
// overlap: two tensors in one place). Each layer's ranges, adjacent ones merged, let a step
// take a layer's gradient norm while it is in cache.
void Executor::plan_grad_ranges(const std::vector<ParamBinding>& layout) {
    std::vector<Range> all;
    std::vector<std::vector<Range>> by_layer(d_.n_layer + 1);  // the last: outside the layers
    for (const auto& b : layout) {
        if (b.layer < -1 || b.layer >= d_.n_layer)
            throw std::invalid_argument("zoo: parameter " + b.role + " has layer " + std::to_string(b.layer) +
                                        " outside [-1, " + std::to_string(d_.n_layer) + ")");
        if (b.count == 0 || b.offset + b.count > n_params_)
            throw std::invalid_argument("zoo: parameter " + b.role + " (layer " + std::to_string(b.layer) +
                                        ") runs past the parameter arena");
        all.push_back({b.offset, b.count});
        by_layer[b.layer < 0 ? d_.n_layer : b.layer].push_back({b.offset, b.count});
    }
    std::sort(all.begin(), all.end());
    size_t at = 0;
    for (const auto& r : all) {
        if (r.first != at)
            throw std::invalid_argument("zoo: the parameter layout " + std::string(r.first < at ? "overlaps" : "leaves a gap") +
                                        " at float " + std::to_string(std::min(r.first, at)));
        at += r.second;
    }
    if (at != n_params_)
        throw std::invalid_argument("zoo: the parameter layout covers " + std::to_string(at) + " of " +
                                    std::to_string(n_params_) + " floats");
    for (auto& ranges : by_layer) {
        std::sort(ranges.begin(), ranges.end());
        std::vector<Range> merged;
        for (const auto& r : ranges) {
            if (!merged.empty() && merged.back().first + merged.back().second == r.first)
                merged.back().second += r.second;
            else
                merged.push_back(r);
        }
        ranges = merged;
    }
    all_grads_ = {{0, n_params_}};  // kept, so a step never builds the list
    other_grad_ranges_ = by_layer.back();
    by_layer.pop_back();
    layer_grad_ranges_ = by_layer;
}

// Floats the kernels read through a role (0: the config has no such tensor). The layout
// decides where each tensor is; this is what the executor's calls read from there, so a table
// row that disagrees is refused instead of read past its end.
static size_t kernel_floats(const Dims& d, const std::string& role) {
    const size_t D = d.d_model, V = d.vocab_size;
    if (role == "wte") return V * D;
    if (role == "wpe") return d.rope ? 0 : (size_t)d.max_seq_len * D;
    if (role == "lm_head_w") return d.tied_embeddings ? 0 : V * D;
    if ((role == "ln2_w" || role == "ln2_b") && !d.layer->second_norm) return 0;
    if (role == "ln1_w" || role == "ln2_w" || role == "lnf_w") return D;
    if (role == "ln1_b" || role == "ln2_b" || role == "lnf_b") return d.norm->bias ? D : 0;
    if (role == "qkv_w") return (size_t)d.qkv_dim() * D;
    if (role == "qkv_b") return d.attention_bias ? d.qkv_dim() : 0;
    if (role == "attn_out_w") return D * d.attn_dim();
    if (role == "attn_out_b") return d.attention_bias ? D : 0;
    if (role == "fc_w") return (size_t)d.fc_dim() * D;
    if (role == "fc_b") return d.mlp_bias ? d.fc_dim() : 0;
    if (role == "proj_w") return D * d.d_ff;
    if (role == "proj_b") return d.mlp_bias ? D : 0;
    return 0;
}

// The layout table bound in one loop: each row's pointer goes to its role's field.
void Executor::bind(ModelTensors& t, float* base, const std::vector<ParamBinding>& layout) const {
    t = ModelTensors{};
    t.layers.resize(d_.n_layer);
    for (const auto& b : layout) {
        float** slot = nullptr;
#define ZOO_MATCH_ROLE(r) \
    if (b.role == #r) slot = &tensors.r;
        if (b.layer < 0) {
            ModelTensors& tensors = t;
            ZOO_MODEL_ROLES(ZOO_MATCH_ROLE)
        } else {
            LayerTensors& tensors = t.layers[b.layer];
            ZOO_LAYER_ROLES(ZOO_MATCH_ROLE)
        }
#undef ZOO_MATCH_ROLE
        const std::string at = b.layer < 0 ? " outside the layers" : " in layer " + std::to_string(b.layer);
        if (!slot) throw std::invalid_argument("zoo: no parameter role " + b.role + at);
        if (*slot) throw std::invalid_argument("zoo: parameter role " + b.role + at + " is bound twice");
        const size_t read = kernel_floats(d_, b.role);
        if (read == 0)
            throw std::invalid_argument("zoo: parameter role " + b.role + at + " is bound, but the config has no such tensor");
        if (b.count != read)
            throw std::invalid_argument("zoo: parameter role " + b.role + at + " has " + std::to_string(b.count) +
                                        " floats in the layout; the kernels read " + std::to_string(read));
        *slot = base + b.offset;
    }
    auto need = [&](float* p, const char* role, int layer) {
        if (!p && kernel_floats(d_, role))
            throw std::invalid_argument(std::string("zoo: parameter role ") + role + " is not bound" +
                                        (layer < 0 ? "" : " in layer " + std::to_string(layer)));
    };
#define ZOO_NEED_MODEL(r) need(t.r, #r, -1);
    ZOO_MODEL_ROLES(ZOO_NEED_MODEL)
#undef ZOO_NEED_MODEL
    for (int i = 0; i < d_.n_layer; i++) {
#define ZOO_NEED_LAYER(r) need(t.layers[i].r, #r, i);
        ZOO_LAYER_ROLES(ZOO_NEED_LAYER)
#undef ZOO_NEED_LAYER
    }
}

// Sum of squares of the gradients in ranges: float blocks of 1024 (vectorized), their sums
// in double. One parallel region; each thread takes its static share of every range.
double Executor::grad_sum_squares(const std::vector<Range>& ranges) const {
    const float* g = store_.data + n_params_;
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    for (const auto& r : ranges) {
        const long n = (long)r.second, block = 1024;
        const float* x = g + r.first;
#pragma omp for schedule(static) nowait
        for (long b0 = 0; b0 < n; b0 += block) {
            const long end = std::min(n, b0 + block);
            float s = 0.0f;
            for (long i = b0; i < end; i++) s += x[i] * x[i];
            total += s;
        }
    }
    return total;
}

// Rows of the LM head handled at once: the logits of one chunk live in the arena, never the
// logits of the whole batch, so the head costs O(chunk * vocab) memory in training. A chunk
// may fill the buffers that are dead while the head runs (dead_floats) or a budget of 8M
// floats, and has at least 1024 rows: the head's GEMMs are a third of a GPT-2 step and run
// faster on more rows, since each chunk packs the whole head weight again (GPT-2's head over
// 1024 rows, hot: chunks of 256 rows 864-890 ms, 512 rows 783-807 ms, one of 1024 rows
// 766-787 ms; a one-layer GPT-2 step at 4 x 256, A/B three times: 922-986 ms in chunks of
// 512, 872-904 ms in one chunk, for 98 MiB more arena; docs/benchmarks.md). With activation
// checkpointing the chunk takes no memory of its own beyond a 4M-float budget. A bf16 step
// keeps its activations in half the memory, and there the 1024-row minimum would make the
// chunk the largest buffer of a small batch (GPT-2 at 4 x 64: 49 MiB of a 105 MiB arena): it
// takes the budget or half of what else is live while the head runs, no more rows than fp32
// (GPT-2's head over 256 rows: 89.5 ms in one chunk, 141 ms in two of 128;
// docs/benchmarks.md). Evened out so the last chunk is not a sliver.
static int head_chunk_rows(size_t N, int V, bool checkpointing, Precision precision, size_t dead_floats,
                           size_t live_floats) {
    const size_t budget = std::max<size_t>(checkpointing ? 4u << 20 : 8u << 20, dead_floats);
    size_t max_rows = std::max<size_t>(checkpointing ? 16 : 1024, budget / V);
    if (precision == Precision::bf16 && !checkpointing)
        max_rows = std::min(max_rows, std::max<size_t>(16, std::max(budget, live_floats / 2) / V));
    const size_t chunks = (N + max_rows - 1) / max_rows;
    return (int)((N + chunks - 1) / chunks);  // at most N, which limits::max_tokens keeps an int
}

// The pullbacks the AD choice picks for the model's blocks: scratch needs, in floats. Layers'
// pullbacks run one at a time and share one region; the cross-entropy pullback runs while the
// LM head's logits chunk is live and has its own.
static size_t pullback_scratch_floats(const Dims& d, const AdChoice& ad, int B, int T, int threads) {
    const Attention attn{d.n_head, d.n_kv_head, d.head_dim};
    auto need = [&](ScratchFloats f, int C) { return f ? f(C, threads) : 0; };
    size_t n = need(ad.on(d.norm->name) ? d.norm->clad_scratch_floats : d.norm->scratch_floats, d.d_model);
    if (ad.on(d.mlp->name)) n = std::max(n, need(d.mlp->clad_scratch_floats, d.d_ff));
    n = std::max(n, ad.on("attention") ? attn.clad_scratch_floats(threads, T) : attn.scratch_floats(threads, T));
    if (d.rope && ad.on("rope")) n = std::max(n, RoPE{d.head_dim}.clad_scratch_floats(threads));
    if (ad.on("linear")) {  // the replayed bias add of the widest layer with a bias
        int widest = 0;
        if (d.attention_bias) widest = std::max(d.qkv_dim(), d.d_model);
        if (d.mlp_bias) widest = std::max({widest, d.fc_dim(), d.d_model});
        n = std::max(n, Linear{0, widest}.clad_scratch_floats(B * T));  // B * T: check_batch bounds it
    }
    return n;
}

// Every buffer of a training step with the phases it is live in; the planner places them.
// Declared longest-lived first, so the head's logits chunk lands on the buffers dead while the
// head runs (the layers' adjoints and scratch; with checkpointing the shared internals).
// bf16_saved: keep q|k|v, the attention output and the MLP input in bf16 (a bf16 step without
// checkpointing only; plan_activations decides).
static ActivationPlan plan_buffers(const Dims& d, bool checkpointing, Precision precision, bool bf16_saved,
                                   const AdChoice& ad, int B, int T, float* base, size_t* total_floats) {
    limits::check_batch(B, T, "activation plan");  // N = B * T below is an int in the kernels
    const size_t N = (size_t)B * T, D = d.d_model;
    const int threads = omp_get_max_threads();
    const int stats = d.norm->stats_per_row;
    LivenessPlanner pl;
    struct Slot { float** ptr; size_t index; };
    std::vector<Slot> slots;
    ActivationPlan p;
    auto take = [&](float** ptr, std::string name, size_t floats, unsigned live) {
        slots.push_back({ptr, pl.add(std::move(name), floats, live)});
    };
    // Written by the forward, read by the pullback: live throughout.
    take(&p.residual, "residual", (d.n_layer + 1) * N * D, kAllPhases);
    p.layers.resize(d.n_layer);
    const unsigned internals = checkpointing ? kForward | kPullback : kAllPhases;
    const int saved_sets = checkpointing ? 1 : d.n_layer;  // with checkpointing, one set recomputed per layer
    // Kept in bf16 (bf16.hpp), the layers work on them in fp32 buffers they share.
    std::vector<float*> qkv_bf16(saved_sets), att_bf16(saved_sets), fc_bf16(saved_sets);
    auto take_saved = [&](float** fp32, float** bf16, const std::string& name, size_t floats) {
        if (bf16_saved)
            take(bf16, name + "_bf16", (floats + 1) / 2, internals);
        else
            take(fp32, name, floats, internals);
    };
    for (int i = 0; i < saved_sets; i++) {
        LayerActs& l = p.layers[i];
        const std::string at = checkpointing ? "layers." : "layer" + std::to_string(i) + ".";
        take(&l.ln1_stats, at + "ln1_stats", stats * N, internals);
        take_saved(&l.qkv, &qkv_bf16[i], at + "qkv", N * d.qkv_dim());
        take(&l.lse, at + "lse", (size_t)B * d.n_head * T, internals);
        take_saved(&l.att, &att_bf16[i], at + "att", N * d.attn_dim());
        if (d.layer->second_norm) {
            take(&l.res_mid, at + "res_mid", N * D, internals);
            take(&l.ln2_stats, at + "ln2_stats", stats * N, internals);
        }
        take_saved(&l.fc, &fc_bf16[i], at + "fc", N * d.fc_dim());
    }
    take(&p.lnf, "lnf", N * D, kForward | kHead);
    take(&p.lnf_stats, "lnf_stats", stats * N, kAllPhases);
    take(&p.row_loss, "row_loss", N, kHead);
    take(&p.d_norm, "d_norm", N * D, kHead | kPullback);  // the head writes dL/d(final norm)
    // Norm outputs and the activation's output feed one GEMM each and are cheap to recompute:
    // all layers share one buffer for each, recomputed in the pullback.
    float *norm_out = nullptr, *act_out = nullptr;
    take(&norm_out, "norm_out", N * D, kForward | kPullback);
    take(&act_out, "act_out", N * d.d_ff, kForward | kPullback);
    float *qkv_work = nullptr, *att_work = nullptr, *fc_work = nullptr;
    if (bf16_saved) {
        take(&qkv_work, "qkv_work", N * d.qkv_dim(), kForward | kPullback);
        take(&att_work, "att_work", N * d.attn_dim(), kForward | kPullback);
        take(&fc_work, "fc_work", N * d.fc_dim(), kForward | kPullback);
    }
    take(&p.attention_scratch, "attention_scratch",
         Attention{d.n_head, d.n_kv_head, d.head_dim}.scratch_floats(threads, T),
         checkpointing ? kForward | kPullback : kForward);
    take(&p.d_res, "d_res", N * D, kPullback);
    take(&p.d_qkv, "d_qkv", N * d.qkv_dim(), kPullback);
    take(&p.d_att, "d_att", N * d.attn_dim(), kPullback);
    take(&p.d_fc, "d_fc", N * d.fc_dim(), kPullback);
    take(&p.d_act, "d_act", N * d.d_ff, kPullback);
    if (d.layer->forward) take(&p.d_layer_in, "d_layer_in", N * D, kPullback);
    take(&p.pullback_scratch, "pullback_scratch", pullback_scratch_floats(d, ad, B, T, threads), kPullback);
    pl.place();
    // The head's chunk fills what is free above the buffers live while it runs.
    p.head_rows = head_chunk_rows(N, d.vocab_size, checkpointing, precision, pl.total() - pl.end_of(kHead),
                                  pl.end_of(kHead));
    take(&p.head_logits, "head_logits", (size_t)p.head_rows * d.vocab_size, kHead);
    if (ad.on("cross_entropy"))
        take(&p.head_scratch, "head_scratch", CrossEntropy{d.vocab_size}.clad_scratch_floats(threads), kHead);
    pl.place();
    pl.check();
    for (const Slot& s : slots) *s.ptr = base ? base + pl[s.index].offset : nullptr;
    for (int i = 0; i < d.n_layer; i++) {
        LayerActs& l = p.layers[i];
        if (checkpointing) l = p.layers[0];
        l.x = p.residual ? p.residual + (size_t)i * N * D : nullptr;
        l.out = p.residual ? p.residual + (size_t)(i + 1) * N * D : nullptr;
        l.ln1 = l.ln2 = norm_out;
        l.act = act_out;
        if (bf16_saved) {
            l.qkv = qkv_work, l.att = att_work, l.fc = fc_work;
            l.qkv_bf16 = reinterpret_cast<uint16_t*>(qkv_bf16[i]);
            l.att_bf16 = reinterpret_cast<uint16_t*>(att_bf16[i]);
            l.fc_bf16 = reinterpret_cast<uint16_t*>(fc_bf16[i]);
        }
    }
    p.buffers = pl.buffers();
    if (total_floats) *total_floats = pl.total();
    return p;
}

// A bf16 step keeps the outputs of its products in bf16 where that takes less memory: the fp32
// buffers the layers share cost more than the halving saves in a model of one or two layers.
// (With checkpointing they are recomputed, not kept.)
ActivationPlan plan_activations(const Dims& d, bool checkpointing, Precision precision, const AdChoice& ad, int B,
                                int T, float* base, size_t* total_floats) {
    bool bf16_saved = false;
    if (precision == Precision::bf16 && !checkpointing) {
        size_t kept_fp32 = 0, kept_bf16 = 0;
        plan_buffers(d, checkpointing, precision, false, ad, B, T, nullptr, &kept_fp32);
        plan_buffers(d, checkpointing, precision, true, ad, B, T, nullptr, &kept_bf16);
        bf16_saved = kept_bf16 < kept_fp32;
    }
    return plan_buffers(d, checkpointing, precision, bf16_saved, ad, B, T, base, total_floats);
}

size_t activation_floats(const Dims& d, bool checkpointing, Precision precision, int B, int T, const AdChoice& ad) {
    size_t total = 0;
    plan_activations(d, checkpointing, precision, ad, B, T, nullptr, &total);
    return total;
}

void Executor::set_checkpointing(bool on) {
    if (on != checkpointing_) {
        checkpointing_ = on;
        cap_B_ = cap_T_ = 0;  // re-plan at the next step
    }
}

AdChoice ad_choice(const Dims& d, const std::vector<std::string>& clad_blocks) {
    AdChoice ad;
    const auto infos = block_infos();
    for (const auto& name : clad_blocks) {
        auto it = std::find_if(infos.begin(), infos.end(), [&](const BlockInfo& b) { return b.name == name; });
        if (it == infos.end()) throw std::invalid_argument("zoo: no block named " + name);
        if (!it->clad)
            throw std::runtime_error(clad_built ? "zoo: block " + name + " has no Clad pullback"
                                                : std::string("zoo: the Clad backend was not built into this zoo; rebuild "
                                                              "with ZOO_CLAD_DIR=<Clad prefix> CXX=<its clang++> "
                                                              "(docs/clad.md)"));
        ad.clad.insert(name);
    }
    if (!d.norm->pullback && d.norm->pullback_clad) ad.clad.insert(d.norm->name);
    if (!d.mlp->pullback && d.mlp->pullback_clad) ad.clad.insert(d.mlp->name);
    return ad;
}

// Picks every pullback of the model from the registry, as the AD choice says. A block with no
// pullback in this build stays null: check_trainable says so.
void Executor::set_clad_blocks(const std::vector<std::string>& names) {
    const AdChoice ad = ad_choice(d_, names);
    auto pick = [&](const auto& manual, const auto& clad, const char* name) { return ad.on(name) ? clad : manual; };
    Pullbacks pb;
    pb.norm = pick(d_.norm->pullback, d_.norm->pullback_clad, d_.norm->name);
    pb.activation = pick(d_.mlp->pullback, d_.mlp->pullback_clad, d_.mlp->name);
    pb.linear = pick(linear_block.pullback, linear_block.pullback_clad, "linear");
    pb.attention = pick(attention_block.pullback, attention_block.pullback_clad, "attention");
    pb.rope = pick(rope_block.pullback, rope_block.pullback_clad, "rope");
    pb.embedding = pick(embedding_block.pullback, embedding_block.pullback_clad, "embedding");
    pb.cross_entropy = pick(cross_entropy_block.pullback, cross_entropy_block.pullback_clad, "cross_entropy");
    pb.layer = d_.layer->pullback_clad;
    if (pb.activation && pb.activation == d_.mlp->pullback && pb.linear == linear_block.pullback)
        pb.activation_fused = d_.mlp->recompute_and_pullback;
    ad_ = ad;
    pb_ = pb;
    cap_B_ = cap_T_ = 0;  // the scratch needs change: re-plan at the next step
}

// A block without a pullback in this build (one written as a forward only, without Clad)
// runs forward but cannot train.
void Executor::check_trainable() const {
    if (d_.layer->forward && !pb_.layer)
        throw std::runtime_error(std::string("zoo: layer='") + d_.layer->name +
                                 "' is written as a forward over block calls, and its pullback is the one Clad "
                                 "generates from it, which needs the Clad backend this build does not have: the "
                                 "model runs forward (logits, generation) but cannot train. Rebuild zoo with "
                                 "ZOO_CLAD_DIR=<Clad prefix> CXX=<its clang++> (docs/clad.md)");
    if (!pb_.norm || !pb_.activation) {
        const char* name = !pb_.norm ? d_.norm->name : d_.mlp->name;
        throw std::runtime_error(std::string("zoo: block '") + name +
                                 "' has no hand-written pullback, and its generated one comes from the Clad "
                                 "backend, which this build does not have: the model runs forward (logits, "
                                 "generation) but cannot train. Rebuild zoo with ZOO_CLAD_DIR=<Clad prefix> "
                                 "CXX=<its clang++> (docs/clad.md)");
    }
}

void Executor::set_precision(Precision p) {
    gemm::require_precision(p);
    if (p != precision_) cap_B_ = cap_T_ = 0;  // bf16 keeps some activations in bf16: re-plan
    precision_ = p;
}

void Executor::plan(int B, int T) {
    limits::check_batch(B, T, "batch");
    if (T > d_.max_seq_len)
        throw std::invalid_argument("zoo: sequence length " + std::to_string(T) + " exceeds max_seq_len " +
                                    std::to_string(d_.max_seq_len));
    // Attention tiles are laid out for T; per-thread scratch for the threads planned.
    if (B <= cap_B_ && T == cap_T_ && omp_get_max_threads() <= cap_threads_) return;
    acts_.reset(activation_floats(B, T), "activation arena");
    a_ = plan_activations(d_, checkpointing_, precision_, ad_, B, T, acts_.data, nullptr);
    cap_B_ = B;
    cap_T_ = T;
    cap_threads_ = omp_get_max_threads();
}

void Executor::norm_forward(const float* x, const float* w, const float* b, float* y, float* stats, int N) const {
    d_.norm->forward({d_.d_model, d_.norm_eps, N, x, w, b, stats}, y, stats);
}

void Executor::norm_pullback(const float* x, const float* w, const float* b, const float* stats, const float* dy,
                             float* dx, float* dw, float* db, int N, GradMode mode) const {
    pb_.norm({d_.d_model, d_.norm_eps, N, x, w, b, stats}, dy, dx, dw, db, a_.pullback_scratch, mode);
}

void Executor::check_ids(const int32_t* tokens, const int32_t* targets, int N) const {
    const int V = d_.vocab_size;
    for (int n = 0; n < N; n++) {
        if (tokens[n] < 0 || tokens[n] >= V)
            throw std::invalid_argument("zoo: token id " + std::to_string(tokens[n]) + " outside the vocabulary [0, " +
                                        std::to_string(V) + ")");
        if (targets && targets[n] != CrossEntropy::ignore_index && (targets[n] < 0 || targets[n] >= V))
            throw std::invalid_argument("zoo: target id " + std::to_string(targets[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
    }
}

// Packed rows: each example's positions count 0, 1, 2, ... from where it starts, and a row
// starts with one. Anything else would send attention outside the row or outside its example.
void Executor::check_positions(const int32_t* positions, int B, int T) const {
    if (!positions) return;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int32_t p = positions[(size_t)b * T + t], prev = t ? positions[(size_t)b * T + t - 1] : -1;
            if (p != 0 && p != prev + 1)
                throw std::invalid_argument("zoo: positions[" + std::to_string(b) + ", " + std::to_string(t) +
                                            "] = " + std::to_string(p) + " after " + std::to_string(prev) +
                                            ": positions count up by one from 0, restarting at 0 where a packed "
                                            "example begins (a row begins with one)");
        }
}

// Sets the running step's positions for the kernels, and clears them however the step ends.
struct PositionsScope {
    const int32_t*& slot;
    PositionsScope(const int32_t*& s, const int32_t* p) : slot(s) { slot = p; }
    ~PositionsScope() { slot = nullptr; }
};

LayerCall Executor::layer_call(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0, GradMode mode) {
    const size_t layer_kv = (size_t)cache_B_ * d_.n_kv_head * cache_len_ * d_.head_dim;
    const bool cached = pass == LayerPass::cached;
    return LayerCall{&d_, precision_, &pb_, &w_.layers[i], &g_.layers[i], &a, &a_, rope_cos_.data(), rope_sin_.data(),
                     positions_, a_.attention_scratch, cached ? k_cache_ + i * layer_kv : nullptr,
                     cached ? v_cache_ + i * layer_kv : nullptr, c_probs_, cache_len_, B, T, pos0, pass, mode,
                     &profile};
}

void Executor::layer_forward(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0) {
    if (d_.layer->forward) return d_.layer->forward(layer_call(i, a, B, T, pass, pos0, GradMode::add));
    const int N = B * T, d = d_.d_model;
    const LayerTensors& w = w_.layers[i];
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv = linear(d, d_.qkv_dim()), attn_out = linear(d_.attn_dim(), d), fc = linear(d, d_.fc_dim()),
                 proj = linear(d_.d_ff, d);
    TIMED(forward, norm, norm_forward(a.x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_stats, N));
    TIMED(forward, linear, qkv.forward(a.ln1, w.qkv_w, w.qkv_b, a.qkv, N));
    if (d_.rope)  // q and k heads are adjacent: rotate n_head + n_kv_head heads per row
        TIMED(forward, rope, RoPE{d_.head_dim}.forward(a.qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head,
                                                       rope_cos_.data(), rope_sin_.data(), B, T, positions_, pos0));
    if (pass == LayerPass::cached) {
        // This call's keys and values join the cache; its queries attend to everything cached.
        const size_t layer_kv = (size_t)B * d_.n_kv_head * cache_len_ * d_.head_dim;
        float *kc = k_cache_ + i * layer_kv, *vc = v_cache_ + i * layer_kv;
        append_kv_cache(d_, a.qkv, kc, vc, B, T, pos0, cache_len_);
        TIMED(forward, attention, attn.forward_cached(a.qkv, kc, vc, c_probs_, a.att, B, T, pos0, cache_len_));
    } else {
        if (a.qkv_bf16) round_and_save_bf16(a.qkv, a.qkv_bf16, (size_t)N * d_.qkv_dim());
        TIMED(forward, attention, attn.forward(a.qkv, positions_, a.lse, a.att, a_.attention_scratch, B, T));
        if (a.att_bf16) round_and_save_bf16(a.att, a.att_bf16, (size_t)N * d_.attn_dim());
    }
    // The residual adds are fused into the projections (res_mid = x + att W^T + b): the
    // profile counts them as linear.
    TIMED(forward, linear, attn_out.forward(a.att, w.attn_out_w, w.attn_out_b, a.res_mid, N, a.x));
    TIMED(forward, norm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
    TIMED(forward, linear, fc.forward(a.ln2, w.fc_w, w.fc_b, a.fc, N));
    if (a.fc_bf16) round_and_save_bf16(a.fc, a.fc_bf16, (size_t)N * d_.fc_dim());
    TIMED(forward, activation, d_.mlp->forward(d_.d_ff, a.fc, a.act, N));
    if (pass == LayerPass::recompute) return;  // the MLP output only feeds the next layer's input
    TIMED(forward, linear, proj.forward(a.act, w.proj_w, w.proj_b, a.out, N, a.res_mid));
}

// a_.d_res holds dL/d(layer output) on entry and dL/d(layer input) on exit: the residual adds
// pass it through unchanged, so the norm pullbacks add their parts into it.
void Executor::layer_pullback(int i, int B, int T, GradMode mode) {
    if (d_.layer->forward) return pb_.layer(layer_call(i, a_.layers[i], B, T, LayerPass::replay, 0, mode));
    const int N = B * T, d = d_.d_model;
    const LayerTensors& w = w_.layers[i];
    LayerTensors& g = g_.layers[i];
    const LayerActs& a = a_.layers[i];
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv = linear(d, d_.qkv_dim()), attn_out = linear(d_.attn_dim(), d), fc = linear(d, d_.fc_dim()),
                 proj = linear(d_.d_ff, d);
    float* scratch = a_.pullback_scratch;
    if (a.qkv_bf16) {  // a bf16 step: this layer's saved values into the buffers the layers share
        expand_bf16(a.qkv_bf16, a.qkv, (size_t)N * d_.qkv_dim());
        expand_bf16(a.att_bf16, a.att, (size_t)N * d_.attn_dim());
        expand_bf16(a.fc_bf16, a.fc, (size_t)N * d_.fc_dim());
    }
    // The norm outputs and the activation output live in buffers every layer shares: recompute
    // this layer's before the GEMM pullbacks read them. With the hand-written pullbacks the MLP
    // runs dL/d(act) first, then the activation's recompute and pullback in one pass, then the
    // projection's weight gradient from the recomputed act.
    if (pb_.activation_fused) {
        TIMED(pullback, linear, proj.pullback_input(w.proj_w, a_.d_res, a_.d_act, N));
        TIMED(pullback, activation, pb_.activation_fused(d_.d_ff, a.fc, a_.d_act, a.act, a_.d_fc, N));
        TIMED(pullback, linear, proj.pullback_params(a.act, a_.d_res, g.proj_w, g.proj_b, N, mode));
    } else {
        TIMED(pullback, activation, d_.mlp->forward(d_.d_ff, a.fc, a.act, N));
        TIMED(pullback, linear, pb_.linear(proj, a.act, w.proj_w, w.proj_b, a_.d_res, a_.d_act, g.proj_w, g.proj_b,
                                           N, mode, scratch));
        TIMED(pullback, activation, pb_.activation(d_.d_ff, a.fc, a_.d_act, a_.d_fc, scratch, N));
    }
    TIMED(pullback, norm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
    TIMED(pullback, linear, pb_.linear(fc, a.ln2, w.fc_w, w.fc_b, a_.d_fc, a_.d_norm, g.fc_w, g.fc_b, N, mode,
                                       scratch));
    TIMED(pullback, norm, norm_pullback(a.res_mid, w.ln2_w, w.ln2_b, a.ln2_stats, a_.d_norm, a_.d_res, g.ln2_w,
                                        g.ln2_b, N, mode));
    TIMED(pullback, linear, pb_.linear(attn_out, a.att, w.attn_out_w, w.attn_out_b, a_.d_res, a_.d_att,
                                       g.attn_out_w, g.attn_out_b, N, mode, scratch));
    TIMED(pullback, attention, pb_.attention(attn, a.qkv, positions_, a.lse, a_.d_att, a_.d_qkv, scratch, B, T));
    if (d_.rope)
        TIMED(pullback, rope, pb_.rope(RoPE{d_.head_dim}, a_.d_qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head,
                                       rope_cos_.data(), rope_sin_.data(), B, T, positions_, scratch));
    TIMED(pullback, norm, norm_forward(a.x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_stats, N));
    TIMED(pullback, linear, pb_.linear(qkv, a.ln1, w.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm, g.qkv_w, g.qkv_b, N,
                                       mode, scratch));
    TIMED(pullback, norm, norm_pullback(a.x, w.ln1_w, w.ln1_b, a.ln1_stats, a_.d_norm, a_.d_res, g.ln1_w, g.ln1_b,
                                        N, mode));
}

// Embedding, every layer, final norm: leaves a_.lnf ready for the head.
void Executor::trunk_forward(const int32_t* tokens, int B, int T) {
    const int N = B * T, d = d_.d_model;
    TIMED(forward, embedding, Embedding{d}.forward(tokens, positions_, w_.wte, w_.wpe, a_.residual, B, T));
    for (int i = 0; i < d_.n_layer; i++) layer_forward(i, a_.layers[i], B, T, LayerPass::train);
    TIMED(forward, norm, norm_forward(a_.layers.back().out, w_.lnf_w, w_.lnf_b, a_.lnf, a_.lnf_stats, N));
}

// LM head and cross-entropy, chunk by chunk of rows. With pullback, each chunk's logits turn
// into their adjoint at once and flow into a_.d_norm (dL/d lnf) and the head's weight gradient,
// which the first chunk writes or adds per mode and later chunks add to.
double Executor::head(const int32_t* targets, int N, bool pullback, float grad_scale, GradMode mode) {
    const int d = d_.d_model, V = d_.vocab_size;
    const CrossEntropy ce{V};
    const Linear lm = linear(d, V);
    int n_valid = 0;
    for (int n = 0; n < N; n++) n_valid += targets[n] != CrossEntropy::ignore_index;
    double total = 0.0;
    for (int r0 = 0; r0 < N; r0 += a_.head_rows) {
        const int rows = std::min(a_.head_rows, N - r0);
        const float* x = a_.lnf + (size_t)r0 * d;
        int counted = 0;
        double chunk_mean = 0.0;
        TIMED(forward, linear, lm.forward(x, head_weight(), nullptr, a_.head_logits, rows));
        if (!pullback) {
            TIMED(forward, cross_entropy,
                  chunk_mean = ce.forward(a_.head_logits, targets + r0, a_.row_loss + r0, rows, &counted));
            total += chunk_mean * counted;
            continue;
        }
        // The hand-written pullback is fused with the forward: the profile counts it as forward.
        TIMED(forward, cross_entropy,
              chunk_mean = pb_.cross_entropy(ce, a_.head_logits, targets + r0, a_.row_loss + r0, rows, n_valid,
                                             grad_scale, &counted, a_.head_scratch));
        total += chunk_mean * counted;
        TIMED(pullback, linear, pb_.linear(lm, x, head_weight(), nullptr, a_.head_logits, a_.d_norm + (size_t)r0 * d,
                                           head_grad(), nullptr, rows, r0 == 0 ? mode : GradMode::add, nullptr));
    }
    return n_valid ? total / n_valid : 0.0;
}

void Executor::poison_dead_buffers(unsigned phase) {
    if (!poison_dead_) return;
    std::vector<Range> live;
    for (const auto& b : a_.buffers)
        if (b.live & phase) live.push_back({b.offset, b.floats});
    std::sort(live.begin(), live.end());
    size_t at = 0;
    for (const auto& r : live) {
        if (r.first > at) std::fill(acts_.data + at, acts_.data + r.first, NAN);
        at = std::max(at, r.first + r.second);
    }
    if (acts_.size > at) std::fill(acts_.data + at, acts_.data + acts_.size, NAN);
}

double Executor::forward(const int32_t* tokens, const int32_t* targets, const int32_t* positions, int B, int T) {
    plan(B, T);
    const int N = B * T;
    check_ids(tokens, targets, N);
    check_positions(positions, B, T);
    const PositionsScope scope(positions_, positions);
    poison_dead_buffers(kForward);
    trunk_forward(tokens, B, T);
    poison_dead_buffers(kHead);
    if (targets) return head(targets, N, false, 0.0f, GradMode::add);
    // Full logits only for callers that ask for them (inference): their own arena.
    const size_t need = (size_t)N * d_.vocab_size;
    if (logits_arena_.size < need) logits_arena_.reset(need, "logits");
    TIMED(forward, linear,
          linear(d_.d_model, d_.vocab_size).forward(a_.lnf, head_weight(), nullptr, logits_arena_.data, N));
    return NAN;
}

double Executor::forward_backward(const int32_t* tokens, const int32_t* targets, const int32_t* positions, int B,
                                  int T, float grad_scale) {
    check_trainable();
    plan(B, T);
    const int N = B * T, d = d_.d_model;
    check_ids(tokens, targets, N);
    check_positions(positions, B, T);
    const PositionsScope scope(positions_, positions);
    const GradMode mode = grads_.pass_mode();
    const bool first = grads_.pass_is_first();
    grads_.begin_pass();
    poison_dead_buffers(kForward);
    trunk_forward(tokens, B, T);
    poison_dead_buffers(kHead);
    double loss = head(targets, N, true, grad_scale, mode);
    poison_dead_buffers(kPullback);
    std::memset(a_.d_res, 0, sizeof(float) * N * d);
    TIMED(pullback, norm, norm_pullback(a_.layers.back().out, w_.lnf_w, w_.lnf_b, a_.lnf_stats, a_.d_norm, a_.d_res,
                                        g_.lnf_w, g_.lnf_b, N, mode));
    // On a first pass each layer's squared norm is taken as soon as its pullback has written
    // the gradients, while they are still in cache: adamw_step's clipping then needs no pass
    // of its own over every gradient.
    double sumsq = 0.0;
    for (int i = d_.n_layer - 1; i >= 0; i--) {
        if (checkpointing_) layer_forward(i, a_.layers[i], B, T, LayerPass::recompute);
        layer_pullback(i, B, T, mode);
        if (first) TIMED(forward, adamw, sumsq += grad_sum_squares(layer_grad_ranges_[i]));
    }
    // A tied dwte holds the LM head's gradient already: the embedding adds to it.
    const Embedding emb{d, d_.vocab_size, d_.max_seq_len};
    TIMED(pullback, embedding, pb_.embedding(emb, tokens, positions_, w_.wte, w_.wpe, a_.d_res, g_.wte, g_.wpe, B, T,
                                             d_.tied_embeddings ? GradMode::add : mode, mode));
    if (first) {
        TIMED(forward, adamw, sumsq += grad_sum_squares(other_grad_ranges_));
        grads_.end_first_pass(sumsq);
    }
    return loss;
}

double Executor::grad_sum_squares(size_t begin, size_t end) const {
    if (begin > end || end > n_params_) throw std::invalid_argument("zoo: gradient range outside the parameters");
    return grad_sum_squares(std::vector<Range>{{begin, end - begin}});
}

void Executor::set_moment_range(size_t begin, size_t end) {
    if (begin >= end || end > n_params_)
        throw std::invalid_argument("zoo: moment range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                    ") is not a non-empty range of the " + std::to_string(n_params_) + " parameters");
    if (moments_.data)
        throw std::logic_error("zoo: the AdamW moments are in use already; set their range before the first step");
    moment_begin_ = begin;
    moment_end_ = end;
}

Arena& Executor::moments() {
    if (!moments_.data) moments_.reset(2 * moment_floats(), "AdamW moments");
    return moments_;
}

double Executor::grad_norm() const {
    if (grads_.norm_valid) return std::sqrt(grads_.sumsq);
    return std::sqrt(grad_sum_squares(all_grads_));
}

void Executor::set_decay_ranges(const std::vector<std::pair<size_t, size_t>>& decayed) {
    for (const auto& r : decayed)
        if (r.first > r.second || r.second > n_params_)
            throw std::invalid_argument("zoo: weight-decay range outside the parameters");
    decay_ranges_ = decayed;
    std::sort(decay_ranges_.begin(), decay_ranges_.end());
}

double Executor::adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay, float max_norm,
                            double norm) {
    double t0 = profile.on ? omp_get_wtime() : 0.0;
    if (norm < 0) norm = grad_norm();
    float scale = 1.0f;
    if (max_norm > 0 && norm > max_norm) scale = (float)(max_norm / (norm + 1e-6));
    step_count++;
    const AdamW opt{lr, beta1, beta2, eps, weight_decay};
    float *m = adam_m(), *v = adam_v();
    const size_t lo = moment_begin_, hi = moment_end_;
    // Walk [lo, hi) alternating undecayed gaps and decayed ranges (absolute offsets; the
    // moments are indexed from lo).
    size_t at = lo;
    auto run = [&](size_t begin, size_t end, bool decay) {
        begin = std::max(begin, lo);
        end = std::min(end, hi);
        if (end > begin)
            opt.update(params() + begin, grads() + begin, m + (begin - lo), v + (begin - lo), end - begin,
                       step_count, decay, scale);
    };
    for (const auto& r : decay_ranges_) {
        run(at, r.first, false);
        run(r.first, r.second, true);
        at = std::max(at, r.second);
    }
    run(at, hi, false);
    grads_.optimizer_step(lo == 0 && hi == n_params_);  // AdamW::update zeroed every gradient it read
    if (profile.on) profile.forward[k_adamw] += omp_get_wtime() - t0;
    return norm;
}

// The generation arena for up to (B, max_len): every buffer live for the whole call, one after
// the other. One function, so that reset_cache and cache_floats (the memory check) agree.
struct CacheLayout {
    size_t k, v, x, norm, stats, qkv, probs, att, fc, act, last, logits, floats;
};
static CacheLayout cache_layout(const Dims& d, int B, int max_len) {
    limits::check_batch(B, max_len, "reset_cache");
    if (max_len > d.max_seq_len)
        throw std::invalid_argument("zoo: generation length " + std::to_string(max_len) + " exceeds max_seq_len " +
                                    std::to_string(d.max_seq_len));
    const size_t D = d.d_model, kv = (size_t)d.n_layer * B * d.n_kv_head * max_len * d.head_dim;
    const size_t N = (size_t)B * max_len;  // the prompt may fill the cache in one call
    // B x n_head x max_len^2 is the one product the bounds do not keep inside 64 bits.
    const size_t probs = limits::product_floats("the KV cache's attention probabilities",
                                                {(uint64_t)B, (uint64_t)d.n_head, (uint64_t)max_len, (uint64_t)max_len});
    ArenaPlanner pl;
    CacheLayout c;
    c.k = pl.take(kv), c.v = pl.take(kv), c.x = pl.take(N * D), c.norm = pl.take(N * D),
    c.stats = pl.take(d.norm->stats_per_row * N), c.qkv = pl.take(N * d.qkv_dim()), c.probs = pl.take(probs),
    c.att = pl.take(N * d.attn_dim()), c.fc = pl.take(N * d.fc_dim()), c.act = pl.take(N * d.d_ff),
    c.last = pl.take((size_t)B * D), c.logits = pl.take((size_t)B * d.vocab_size);
    c.floats = pl.used;
    return c;
}

size_t Executor::cache_floats(int B, int max_len) const { return cache_layout(d_, B, max_len).floats; }

void Executor::reset_cache(int B, int max_len) {
    const CacheLayout c = cache_layout(d_, B, max_len);
    cache_.reset(c.floats, "KV cache");
    float* a = cache_.data;
    k_cache_ = a + c.k;
    v_cache_ = a + c.v;
    c_probs_ = a + c.probs;
    c_last_ = a + c.last;
    c_logits_ = a + c.logits;
    // The residual stream is updated in place; the norms share one output and one stats buffer.
    cached_ = LayerActs{a + c.x,  a + c.norm, a + c.stats, a + c.qkv, nullptr,    a + c.att,
                        a + c.x,  a + c.norm, a + c.stats, a + c.fc,  a + c.act,  a + c.x};
    cache_B_ = B;
    cache_len_ = max_len;
}

const float* Executor::forward_cached(const int32_t* tokens, int B, int T, int pos0) {
    if (!k_cache_ || B != cache_B_) throw std::invalid_argument("zoo: reset_cache(B, max_len) with this batch size first");
    if (T <= 0 || pos0 < 0 || pos0 + T > cache_len_)
        throw std::invalid_argument("zoo: positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + T) +
                                    " exceed the cache length " + std::to_string(cache_len_));
    check_ids(tokens, nullptr, B * T);
    const int d = d_.d_model, V = d_.vocab_size;
    float* x = cached_.out;
    Embedding{d}.forward(tokens, nullptr, w_.wte, w_.wpe, x, B, T, pos0);
    for (int i = 0; i < d_.n_layer; i++) layer_forward(i, cached_, B, T, LayerPass::cached, pos0);
    // Only the last position of each sequence needs logits.
    for (int b = 0; b < B; b++)
        std::memcpy(c_last_ + (size_t)b * d, x + ((size_t)b * T + T - 1) * d, sizeof(float) * d);
    norm_forward(c_last_, w_.lnf_w, w_.lnf_b, cached_.ln1, cached_.ln1_stats, B);
    linear(d, V).forward(cached_.ln1, head_weight(), nullptr, c_logits_, B);
    return c_logits_;
}

}  // namespace zoo
