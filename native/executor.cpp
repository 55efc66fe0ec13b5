#include <omp.h>

#include <algorithm>

#include "model.hpp"

namespace zoo {

// Runs the statement, adding its wall time to profile.<dir>[kind] when profiling is on.
#define TIMED(dir, kind, ...)                                      \
    do {                                                            \
        double t0_ = profile.on ? omp_get_wtime() : 0.0;            \
        __VA_ARGS__;                                                \
        if (profile.on) profile.dir[kind] += omp_get_wtime() - t0_; \
    } while (0)

Executor::Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& bindings,
                   const std::vector<float>& inv_freq)
    : d_(dims), n_params_(n_params) {
    store_.reset(4 * n_params_);
    w_.layers.resize(d_.n_layer);
    g_.layers.resize(d_.n_layer);
    bind(w_, params(), bindings);
    bind(g_, grads(), bindings);
    plan_grad_ranges(bindings);
    if (d_.rope) {
        if ((int)inv_freq.size() != d_.head_dim / 2)
            throw std::invalid_argument("zoo: inv_freq must have head_dim/2 entries");
        size_t n = (size_t)d_.max_seq_len * d_.head_dim / 2;
        rope_cos_.resize(n);
        rope_sin_.resize(n);
        RoPE{d_.head_dim}.build_tables(inv_freq.data(), rope_cos_.data(), rope_sin_.data(),
                                       d_.max_seq_len);
    }
    decay_ranges_.clear();
}

// Floats of the tensor a role binds (fused q|k|v and gate|up included).
size_t Executor::role_floats(const std::string& role) const {
    const size_t d = d_.d_model, V = d_.vocab_size;
    if (role == "wte" || role == "lm_head_w") return V * d;
    if (role == "wpe") return (size_t)d_.max_seq_len * d;
    if (role == "qkv_w") return (size_t)d_.qkv_dim() * d;
    if (role == "qkv_b") return d_.qkv_dim();
    if (role == "attn_out_w") return d * d_.attn_dim();
    if (role == "fc_w") return (size_t)d_.fc_dim() * d;
    if (role == "fc_b") return d_.fc_dim();
    if (role == "proj_w") return d * d_.d_ff;
    return d;  // norm weights and biases, attn_out_b, proj_b
}

// Each layer's gradient ranges and the others', adjacent ones merged. The bindings must
// cover the parameters exactly: a gap would be a gradient no pullback writes.
void Executor::plan_grad_ranges(const std::vector<ParamBinding>& bindings) {
    std::vector<std::vector<Range>> by_layer(d_.n_layer + 1);  // the last: outside the layers
    size_t covered = 0;
    for (const auto& b : bindings) {
        const size_t n = role_floats(b.role);
        if (b.offset + n > n_params_)
            throw std::invalid_argument("zoo: parameter " + b.role + " runs past the parameter arena");
        by_layer[b.layer < 0 ? d_.n_layer : b.layer].push_back({b.offset, n});
        covered += n;
    }
    if (covered != n_params_)
        throw std::invalid_argument("zoo: the parameter bindings cover " + std::to_string(covered) + " of " +
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

void Executor::bind(Weights& w, float* base, const std::vector<ParamBinding>& bindings) {
    for (const auto& b : bindings) {
        float* p = base + b.offset;
        if (b.layer < 0) {
            if (b.role == "wte") w.wte = p;
            else if (b.role == "wpe") w.wpe = p;
            else if (b.role == "lnf_w") w.lnf_w = p;
            else if (b.role == "lnf_b") w.lnf_b = p;
            else if (b.role == "lm_head_w") w.lm_head = p;
            else throw std::invalid_argument("zoo: unknown parameter role " + b.role);
            continue;
        }
        if (b.layer >= d_.n_layer) throw std::invalid_argument("zoo: layer index out of range");
        LayerWeights& l = w.layers[b.layer];
        if (b.role == "ln1_w") l.ln1_w = p;
        else if (b.role == "ln1_b") l.ln1_b = p;
        else if (b.role == "qkv_w") l.qkv_w = p;
        else if (b.role == "qkv_b") l.qkv_b = p;
        else if (b.role == "attn_out_w") l.attn_out_w = p;
        else if (b.role == "attn_out_b") l.attn_out_b = p;
        else if (b.role == "ln2_w") l.ln2_w = p;
        else if (b.role == "ln2_b") l.ln2_b = p;
        else if (b.role == "fc_w") l.fc_w = p;
        else if (b.role == "fc_b") l.fc_b = p;
        else if (b.role == "proj_w") l.proj_w = p;
        else if (b.role == "proj_b") l.proj_b = p;
        else throw std::invalid_argument("zoo: unknown layer parameter role " + b.role);
    }
    // Every tensor the dims call for must be bound.
    bool ln = d_.norm == NormKind::layernorm;
    auto need = [](bool ok, const std::string& what) {
        if (!ok) throw std::invalid_argument("zoo: parameter binding missing: " + what);
    };
    need(w.wte, "wte");
    need(d_.rope || w.wpe, "wpe");
    need(w.lnf_w && (!ln || w.lnf_b), "final norm");
    need(d_.tied_embeddings || w.lm_head, "lm_head");
    for (int i = 0; i < d_.n_layer; i++) {
        const LayerWeights& l = w.layers[i];
        std::string at = " in layer " + std::to_string(i);
        need(l.ln1_w && l.ln2_w && (!ln || (l.ln1_b && l.ln2_b)), "norm" + at);
        need(l.qkv_w && l.attn_out_w && (!d_.attention_bias || (l.qkv_b && l.attn_out_b)),
             "attention" + at);
        need(l.fc_w && l.proj_w && (!d_.mlp_bias || (l.fc_b && l.proj_b)), "mlp" + at);
    }
}

// Rows of the LM head handled at once: the logits of one chunk live in the arena, never the
// logits of the whole batch, so the head costs O(chunk * vocab) memory in training. A chunk
// may fill the buffers that are dead while the head runs (dead_floats) or a budget of 8M
// floats, and has at least 1024 rows: the head's GEMMs are a third of a GPT-2 step and run
// faster on more rows, since each chunk packs the whole head weight again (GPT-2's head over
// 1024 rows, hot: chunks of 256 rows 864-890 ms, 512 rows 783-807 ms, one of 1024 rows
// 766-787 ms; a one-layer GPT-2 step at 4 x 256, A/B three times: 922-986 ms in chunks of
// 512, 872-904 ms in one chunk, for 98 MiB more arena; docs/benchmarks.md). With activation
// checkpointing the chunk takes no memory of its own beyond a 4M-float budget. Evened out
// so the last chunk is not a sliver.
static int head_chunk_rows(int N, int V, bool checkpointing, size_t dead_floats) {
    const long budget = std::max<long>(checkpointing ? 4L << 20 : 8L << 20, (long)dead_floats);
    const long max_rows = std::max<long>(checkpointing ? 16 : 1024, budget / V);
    const long chunks = (N + max_rows - 1) / max_rows;
    return (int)((N + chunks - 1) / chunks);
}

size_t activation_floats(const Dims& d, bool checkpointing, int B, int T, const AdChoice& ad) {
    ArenaPlanner pl;
    layout_activations(d, checkpointing, pl, nullptr, B, T, ad);
    return pl.used;
}

// Scratch for the Clad pullbacks of the blocks this model has on Clad: the largest need, since
// one pullback runs at a time.
static size_t clad_scratch_floats(const Dims& d, const AdChoice& ad, int B, int T, int threads) {
    size_t n = 0;
    auto need = [&](int k, bool used, size_t floats) {
        if (ad.clad[k] && used) n = std::max(n, floats);
    };
    need(kAdLayerNorm, d.norm == NormKind::layernorm, LayerNorm{d.d_model, d.norm_eps}.clad_scratch_floats(threads));
    need(kAdRMSNorm, d.norm == NormKind::rmsnorm, RMSNorm{d.d_model, d.norm_eps}.clad_scratch_floats(threads));
    need(kAdGELU, d.mlp == MlpKind::gelu, GELU{d.d_ff}.clad_scratch_floats(threads));
    need(kAdSwiGLU, d.mlp == MlpKind::swiglu, SwiGLU{d.d_ff}.clad_scratch_floats(threads));
    need(kAdReLU2, d.mlp == MlpKind::relu2, activation_clad_scratch_floats(d.d_ff, threads));
    need(kAdRope, d.rope, RoPE{d.head_dim}.clad_scratch_floats(threads));
    need(kAdAttention, true, Attention{d.n_head, d.n_kv_head, d.head_dim}.clad_scratch_floats(threads, T));
    need(kAdCrossEntropy, true, CrossEntropy{d.vocab_size}.clad_scratch_floats(threads));
    // Linear: the replayed bias add of the widest layer with a bias.
    int widest = 0;
    if (d.attention_bias) widest = std::max(d.qkv_dim(), d.d_model);
    if (d.mlp_bias) widest = std::max({widest, d.fc_dim(), d.d_model});
    need(kAdLinear, widest > 0, Linear{0, widest}.clad_scratch_floats(B * T));
    return n;
}

ActivationPlan layout_activations(const Dims& d_, bool checkpointing, ArenaPlanner& pl, float* base,
                                  int B, int T, const AdChoice& ad) {
    const size_t N = (size_t)B * T, d = d_.d_model;
    auto take = [&](size_t n) { size_t at = pl.take(n); return base ? base + at : nullptr; };
    ActivationPlan p;
    // Live from the forward to the end of the pullback: the residual stream, each layer's
    // saved internals, the final norm, the losses, and dL/d(final norm) the head writes.
    p.residual = take((d_.n_layer + 1) * N * d);
    auto layer = [&](LayerActs& l) {
        l.ln1_mean = take(N); l.ln1_rstd = take(N);
        l.qkv = take(N * d_.qkv_dim());
        l.lse = take((size_t)B * d_.n_head * T);
        l.att = take(N * d_.attn_dim());
        l.res_mid = take(N * d);
        l.ln2_mean = take(N); l.ln2_rstd = take(N);
        l.fc = take(N * d_.fc_dim());
    };
    p.layers.resize(d_.n_layer);
    if (!checkpointing)
        for (auto& l : p.layers) layer(l);
    p.lnf = take(N * d); p.lnf_mean = take(N); p.lnf_rstd = take(N);
    p.row_loss = take(N);
    p.d_norm = take(N * d);
    // Dead while the LM head runs (after the last layer's forward, before its pullback): the
    // head's logits chunk overlaps them. Norm outputs and the activation's output feed one
    // GEMM each and are cheap to recompute: every layer shares one buffer for them, and the
    // pullback recomputes them. With checkpointing, one set of internals serves every layer,
    // recomputed per layer in the pullback.
    const size_t head_start = pl.used;
    float* norm_out = take(N * d);
    float* act_out = take(N * d_.d_ff);
    if (checkpointing) {
        LayerActs shared;
        layer(shared);
        for (auto& l : p.layers) l = shared;
    }
    for (auto& l : p.layers) {
        l.ln1 = l.ln2 = norm_out;
        l.act = act_out;
    }
    p.d_res = take(N * d); p.d_qkv = take(N * d_.qkv_dim());
    p.d_att = take(N * d_.attn_dim()); p.d_fc = take(N * d_.fc_dim()); p.d_act = take(N * d_.d_ff);
    p.attn_scratch = take(Attention{d_.n_head, d_.n_kv_head, d_.head_dim}.scratch_floats(omp_get_max_threads(), T));
    p.norm_scratch = take(LayerNorm{d_.d_model, d_.norm_eps}.scratch_floats(omp_get_max_threads()));  // >= RMSNorm's
    const size_t dead_end = pl.used;
    pl.used = head_start;
    p.head_rows = head_chunk_rows((int)N, d_.vocab_size, checkpointing, dead_end - head_start);
    p.head_logits = take((size_t)p.head_rows * d_.vocab_size);
    pl.used = std::max(pl.used, dead_end);
    // The Clad cross-entropy pullback uses its scratch while the head runs: after both.
    const size_t clad = clad_scratch_floats(d_, ad, B, T, omp_get_max_threads());
    if (clad) p.clad_scratch = take(clad);
    return p;
}

void Executor::set_checkpointing(bool on) {
    if (on != checkpointing_) {
        checkpointing_ = on;
        cap_B_ = cap_T_ = 0;  // re-plan at the next step
    }
}

void Executor::set_clad_blocks(const std::vector<std::string>& names) {
    AdChoice ad;
    for (const auto& name : names) {
        int k = 0;
        while (k < kAdBlocks && name != ad_block_name(k)) k++;
        if (k == kAdBlocks) throw std::invalid_argument("zoo: no block named " + name);
        ad.clad[k] = true;
    }
    if (!names.empty() && !clad_built)
        throw std::runtime_error("zoo: the Clad backend was not built into this zoo; rebuild with "
                                 "ZOO_CLAD_DIR=<Clad prefix> CXX=<its clang++> (docs/clad.md)");
    ad_ = ad;
    cap_B_ = cap_T_ = 0;  // the Clad scratch changes: re-plan at the next step
}

std::vector<std::string> Executor::clad_blocks() const {
    std::vector<std::string> out;
    for (int k = 0; k < kAdBlocks; k++)
        if (ad_.clad[k]) out.push_back(ad_block_name(k));
    return out;
}

// A block without a hand-written pullback (relu2) trains only on the Clad backend.
void Executor::check_trainable() const {
    if (d_.mlp == MlpKind::relu2 && !ad_.clad[kAdReLU2])
        throw std::runtime_error(
            clad_built ? "zoo: block 'relu2' has no hand-written pullback; put it on the Clad backend "
                         "(ad=\"clad\" or ad={\"relu2\": \"clad\"}) to train it"
                       : "zoo: block 'relu2' has no hand-written pullback, and its generated one comes "
                         "from the Clad backend, which this build does not have: the model runs forward "
                         "(logits, generation) but cannot train. Rebuild zoo with ZOO_CLAD_DIR=<Clad prefix> "
                         "CXX=<its clang++> (docs/clad.md)");
}

void Executor::plan(int B, int T) {
    if (B <= 0 || T <= 0) throw std::invalid_argument("zoo: batch and sequence length must be positive");
    if (T > d_.max_seq_len)
        throw std::invalid_argument("zoo: sequence length " + std::to_string(T) +
                                    " exceeds max_seq_len " + std::to_string(d_.max_seq_len));
    // Attention probabilities are laid out T x T; per-thread scratch for the threads planned.
    if (B <= cap_B_ && T == cap_T_ && omp_get_max_threads() <= cap_threads_) return;
    acts_.reset(activation_floats(B, T));
    ArenaPlanner pl;
    a_ = layout_activations(d_, checkpointing_, pl, acts_.data, B, T, ad_);
    cap_B_ = B;
    cap_T_ = T;
    cap_threads_ = omp_get_max_threads();
}

void Executor::norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                            float* rstd, int N) const {
    if (d_.norm == NormKind::layernorm)
        LayerNorm{d_.d_model, d_.norm_eps}.forward(x, w, b, y, mean, rstd, N);
    else
        RMSNorm{d_.d_model, d_.norm_eps}.forward(x, w, y, rstd, N);
}

// The pullbacks with a choice of backend (set_clad_blocks); the Clad branches exist only in a
// Clad build.
void Executor::norm_pullback(const float* x, const float* w, const float* b, const float* mean,
                             const float* rstd, const float* dy, float* dx, float* dw, float* db,
                             int N) const {
    if (d_.norm == NormKind::layernorm) {
        const LayerNorm ln{d_.d_model, d_.norm_eps};
#ifdef ZOO_CLAD
        if (ad_.clad[kAdLayerNorm]) {
            clear_if_writing(dw, d_.d_model);
            clear_if_writing(db, d_.d_model);
            return ln.pullback_clad(x, w, b, dy, dx, dw, db, a_.clad_scratch, N);
        }
#endif
        ln.pullback(x, w, mean, rstd, dy, dx, dw, db, a_.norm_scratch, N, accumulate_params_);
    } else {
        const RMSNorm rms{d_.d_model, d_.norm_eps};
#ifdef ZOO_CLAD
        if (ad_.clad[kAdRMSNorm]) {
            clear_if_writing(dw, d_.d_model);
            return rms.pullback_clad(x, w, dy, dx, dw, a_.clad_scratch, N);
        }
#endif
        rms.pullback(x, w, rstd, dy, dx, dw, a_.norm_scratch, N, accumulate_params_);
    }
}

void Executor::linear_pullback(const Linear& l, const float* x, const float* W, const float* b,
                               const float* dy, float* dx, float* dW, float* db, int N) const {
#ifdef ZOO_CLAD
    if (ad_.clad[kAdLinear]) {
        clear_if_writing(dW, (size_t)l.out * l.in);
        clear_if_writing(db, l.out);
        return l.pullback_clad(x, W, b, dy, dx, dW, db, N, false, a_.clad_scratch);
    }
#endif
    l.pullback(x, W, dy, dx, dW, db, N, /*accumulate_dx=*/false, accumulate_params_);
}

// The Clad pullbacks always add into parameter gradients: on a step that writes them, they
// start from zero.
void Executor::clear_if_writing(float* grad, size_t n) const {
    if (grad && !accumulate_params_) std::memset(grad, 0, sizeof(float) * n);
}

void Executor::check_ids(const int32_t* tokens, const int32_t* targets, int N) const {
    const int V = d_.vocab_size;
    for (int n = 0; n < N; n++) {
        if (tokens[n] < 0 || tokens[n] >= V)
            throw std::invalid_argument("zoo: token id " + std::to_string(tokens[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
        if (targets && targets[n] != CrossEntropy::ignore_index && (targets[n] < 0 || targets[n] >= V))
            throw std::invalid_argument("zoo: target id " + std::to_string(targets[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
    }
}

// Layer i from a_.residual[i]. With full=false it stops after the activation: what a
// checkpointed pullback needs recomputed (the MLP output only feeds a_.residual[i+1]).
void Executor::layer_forward(int i, int B, int T, bool full) {
    const int N = B * T, d = d_.d_model;
    const LayerWeights& w = w_.layers[i];
    LayerActs& a = a_.layers[i];
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv{d, d_.qkv_dim()}, attn_out{d_.attn_dim(), d}, fc{d, d_.fc_dim()}, proj{d_.d_ff, d};
    const float* x = a_.residual + (size_t)i * N * d;
    TIMED(forward, kNorm, norm_forward(x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_mean, a.ln1_rstd, N));
    TIMED(forward, kLinear, qkv.forward(a.ln1, w.qkv_w, w.qkv_b, a.qkv, N));
    if (d_.rope)  // q and k heads are adjacent: rotate n_head + n_kv_head heads per row
        TIMED(forward, kRope, RoPE{d_.head_dim}.forward(a.qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head,
                                                       rope_cos_.data(), rope_sin_.data(), B, T));
    TIMED(forward, kAttention, attn.forward(a.qkv, a.lse, a.att, a_.attn_scratch, B, T));
    // The residual adds are fused into the projections (res_mid = x + att W^T + b): the
    // profile counts them as linear.
    TIMED(forward, kLinear, attn_out.forward(a.att, w.attn_out_w, w.attn_out_b, a.res_mid, N, x));
    TIMED(forward, kNorm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_mean, a.ln2_rstd, N));
    TIMED(forward, kLinear, fc.forward(a.ln2, w.fc_w, w.fc_b, a.fc, N));
    TIMED(forward, kActivation, activation_forward(a.fc, a.act, N));
    if (!full) return;
    float* x_out = a_.residual + (size_t)(i + 1) * N * d;
    TIMED(forward, kLinear, proj.forward(a.act, w.proj_w, w.proj_b, x_out, N, a.res_mid));
}

// a_.d_res holds dL/d(a_.residual[i+1]) on entry and dL/d(a_.residual[i]) on exit: the residual
// adds pass it through unchanged, so the norm pullbacks add their parts into it.
void Executor::layer_pullback(int i, int B, int T) {
    const int N = B * T, d = d_.d_model;
    const LayerWeights& w = w_.layers[i];
    LayerWeights& g = g_.layers[i];
    LayerActs& a = a_.layers[i];
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv{d, d_.qkv_dim()}, attn_out{d_.attn_dim(), d}, fc{d, d_.fc_dim()}, proj{d_.d_ff, d};
    const float* x = a_.residual + (size_t)i * N * d;
    [[maybe_unused]] float* cs = a_.clad_scratch;
    // The norm outputs and the activation output live in buffers every layer shares
    // (layout_activations): recompute this layer's before the GEMM pullbacks read them.
    // With the hand-written GELU or SwiGLU and linear pullbacks the MLP runs dL/d(act) first,
    // then the activation's recompute and pullback in one pass, then the projection's weight
    // gradient from the recomputed act.
    if (mlp_pullback_fused()) {
        TIMED(pullback, kLinear, proj.pullback_input(w.proj_w, a_.d_res, a_.d_act, N));
        TIMED(pullback, kActivation, activation_recompute_and_pullback(a.fc, a_.d_act, a.act, a_.d_fc, N));
        TIMED(pullback, kLinear, proj.pullback_params(a.act, a_.d_res, g.proj_w, g.proj_b, N, accumulate_params_));
    } else {
        TIMED(pullback, kActivation, activation_forward(a.fc, a.act, N));
        TIMED(pullback, kLinear, linear_pullback(proj, a.act, w.proj_w, w.proj_b, a_.d_res, a_.d_act, g.proj_w,
                                                 g.proj_b, N));
        TIMED(pullback, kActivation, activation_pullback(a.fc, a_.d_act, a_.d_fc, N));
    }
    TIMED(pullback, kNorm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_mean, a.ln2_rstd, N));
    TIMED(pullback, kLinear, linear_pullback(fc, a.ln2, w.fc_w, w.fc_b, a_.d_fc, a_.d_norm, g.fc_w, g.fc_b, N));
    TIMED(pullback, kNorm, norm_pullback(a.res_mid, w.ln2_w, w.ln2_b, a.ln2_mean, a.ln2_rstd, a_.d_norm,
                                         a_.d_res, g.ln2_w, g.ln2_b, N));
    TIMED(pullback, kLinear, linear_pullback(attn_out, a.att, w.attn_out_w, w.attn_out_b, a_.d_res, a_.d_att,
                                             g.attn_out_w, g.attn_out_b, N));
#ifdef ZOO_CLAD
    if (ad_.clad[kAdAttention])
        TIMED(pullback, kAttention, attn.pullback_clad(a.qkv, a_.d_att, a_.d_qkv, cs, B, T));
    else
#endif
        TIMED(pullback, kAttention, attn.pullback(a.qkv, a.lse, a_.d_att, a_.d_qkv, a_.attn_scratch, B, T));
    if (d_.rope) {
        const RoPE rope{d_.head_dim};
        const int heads = d_.n_head + d_.n_kv_head;
#ifdef ZOO_CLAD
        if (ad_.clad[kAdRope])
            TIMED(pullback, kRope, rope.pullback_clad(a_.d_qkv, d_.qkv_dim(), heads, rope_cos_.data(),
                                                      rope_sin_.data(), B, T, cs));
        else
#endif
            TIMED(pullback, kRope, rope.pullback(a_.d_qkv, d_.qkv_dim(), heads, rope_cos_.data(),
                                                 rope_sin_.data(), B, T));
    }
    TIMED(pullback, kNorm, norm_forward(x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_mean, a.ln1_rstd, N));
    TIMED(pullback, kLinear, linear_pullback(qkv, a.ln1, w.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm, g.qkv_w,
                                             g.qkv_b, N));
    TIMED(pullback, kNorm, norm_pullback(x, w.ln1_w, w.ln1_b, a.ln1_mean, a.ln1_rstd, a_.d_norm, a_.d_res,
                                         g.ln1_w, g.ln1_b, N));
}

// fc -> act for the model's MLP activation.
void Executor::activation_forward(const float* fc, float* act, int N) const {
    if (d_.mlp == MlpKind::swiglu)
        SwiGLU{d_.d_ff}.forward(fc, act, N);
    else if (d_.mlp == MlpKind::relu2)
        ReLU2{d_.d_ff}.forward(fc, act, N);
    else
        GELU{d_.d_ff}.forward(fc, act, N);
}

// True where the MLP's activation (GELU or SwiGLU) and linear pullbacks are the hand-written
// ones: layer_pullback then fuses the activation's recompute into its pullback.
bool Executor::mlp_pullback_fused() const {
    if (ad_.clad[kAdLinear]) return false;
    if (d_.mlp == MlpKind::gelu) return !ad_.clad[kAdGELU];
    if (d_.mlp == MlpKind::swiglu) return !ad_.clad[kAdSwiGLU];
    return false;
}

void Executor::activation_recompute_and_pullback(const float* fc, const float* d_act, float* act, float* d_fc,
                                                 int N) const {
    if (d_.mlp == MlpKind::swiglu)
        SwiGLU{d_.d_ff}.recompute_and_pullback(fc, d_act, act, d_fc, N);
    else
        GELU{d_.d_ff}.recompute_and_pullback(fc, d_act, act, d_fc, N);
}

// dL/d(act) -> dL/d(fc) for the model's MLP activation.
void Executor::activation_pullback(const float* fc, const float* d_act, float* d_fc, int N) const {
    const int F = d_.d_ff;
    [[maybe_unused]] float* cs = a_.clad_scratch;
    if (d_.mlp == MlpKind::swiglu) {
#ifdef ZOO_CLAD
        if (ad_.clad[kAdSwiGLU]) return SwiGLU{F}.pullback_clad(fc, d_act, d_fc, cs, N);
#endif
        SwiGLU{F}.pullback(fc, d_act, d_fc, N);
    } else if (d_.mlp == MlpKind::gelu) {
#ifdef ZOO_CLAD
        if (ad_.clad[kAdGELU]) return GELU{F}.pullback_clad(fc, d_act, d_fc, cs, N);
#endif
        GELU{F}.pullback(fc, d_act, d_fc, N);
    } else {  // relu2: Clad's pullback only (check_trainable ran)
#ifdef ZOO_CLAD
        activation_pullback_clad<relu2_forward_row>(F, fc, d_act, d_fc, cs, N);
#else
        check_trainable();
#endif
    }
}

// Embedding, every layer, final norm: leaves a_.lnf ready for the head.
void Executor::trunk_forward(const int32_t* tokens, int B, int T) {
    const int N = B * T, d = d_.d_model;
    TIMED(forward, kEmbedding, Embedding{d}.forward(tokens, w_.wte, d_.rope ? nullptr : w_.wpe, a_.residual, B, T));
    for (int i = 0; i < d_.n_layer; i++) layer_forward(i, B, T, true);
    TIMED(forward, kNorm, norm_forward(a_.residual + (size_t)d_.n_layer * N * d, w_.lnf_w, w_.lnf_b, a_.lnf,
                                       a_.lnf_mean, a_.lnf_rstd, N));
}

// LM head and cross-entropy, chunk by chunk of rows. With pullback, each chunk's logits turn
// into their adjoint at once and flow into a_.d_norm (dL/d lnf) and the head's weight gradient.
double Executor::head(const int32_t* targets, int N, bool pullback, float grad_scale) {
    const int d = d_.d_model, V = d_.vocab_size;
    const CrossEntropy ce{V};
    const Linear lm{d, V};
    int n_valid = 0;
    for (int n = 0; n < N; n++) n_valid += targets[n] != CrossEntropy::ignore_index;
    double total = 0.0;
    for (int r0 = 0; r0 < N; r0 += a_.head_rows) {
        const int rows = std::min(a_.head_rows, N - r0);
        const float* x = a_.lnf + (size_t)r0 * d;
        int counted = 0;
        double chunk_mean = 0.0;
        TIMED(forward, kLinear, lm.forward(x, head_weight(), nullptr, a_.head_logits, rows));
#ifdef ZOO_CLAD
        if (pullback && ad_.clad[kAdCrossEntropy]) {
            TIMED(forward, kCrossEntropy,
                  chunk_mean = ce.forward(a_.head_logits, targets + r0, a_.row_loss + r0, rows, &counted));
            TIMED(pullback, kCrossEntropy, ce.pullback_clad(a_.head_logits, targets + r0, rows, n_valid, grad_scale,
                                                            a_.clad_scratch));
        } else
#endif
        if (pullback)  // fused: the profile counts it all as forward
            TIMED(forward, kCrossEntropy,
                  chunk_mean = ce.forward_pullback(a_.head_logits, targets + r0, a_.row_loss + r0, rows,
                                                   n_valid, grad_scale, &counted));
        else
            TIMED(forward, kCrossEntropy,
                  chunk_mean = ce.forward(a_.head_logits, targets + r0, a_.row_loss + r0, rows, &counted));
        total += chunk_mean * counted;
        if (!pullback) continue;
        TIMED(pullback, kLinear, linear_pullback(lm, x, head_weight(), nullptr, a_.head_logits,
                                                 a_.d_norm + (size_t)r0 * d, head_grad(), nullptr, rows));
        accumulate_params_ = true;  // later chunks add to what the first wrote
    }
    return n_valid ? total / n_valid : 0.0;
}

double Executor::forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
    plan(B, T);
    const int N = B * T;
    check_ids(tokens, targets, N);
    trunk_forward(tokens, B, T);
    if (targets) return head(targets, N, false, 0.0f);
    // Full logits only for callers that ask for them (inference): their own arena.
    const size_t need = (size_t)N * d_.vocab_size;
    if (logits_arena_.size < need) logits_arena_.reset(need);
    TIMED(forward, kLinear, Linear{d_.d_model, d_.vocab_size}.forward(a_.lnf, head_weight(), nullptr,
                                                                     logits_arena_.data, N));
    return NAN;
}

double Executor::forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T,
                                  float grad_scale) {
    check_trainable();
    plan(B, T);
    const int N = B * T, d = d_.d_model;
    check_ids(tokens, targets, N);
    // After zero_grads or an optimizer step this step's gradients are the only ones (fresh).
    // After an optimizer step they are zero and the pullbacks add into them; after zero_grads
    // alone the pullbacks write them instead: no clearing pass, and no GEMM reads old ones.
    const bool fresh = grads_consumed_, writing = fresh && !grads_zero_;
    grads_consumed_ = grads_zero_ = false;
    trunk_forward(tokens, B, T);
    accumulate_params_ = !writing;
    double loss = head(targets, N, true, grad_scale);
    accumulate_params_ = !writing;
    std::memset(a_.d_res, 0, sizeof(float) * N * d);
    TIMED(pullback, kNorm, norm_pullback(a_.residual + (size_t)d_.n_layer * N * d, w_.lnf_w, w_.lnf_b,
                                         a_.lnf_mean, a_.lnf_rstd, a_.d_norm, a_.d_res, g_.lnf_w, g_.lnf_b, N));
    // On a fresh step each layer's squared norm is taken as soon as its pullback has written
    // the gradients, while they are still in cache: adamw_step's clipping then needs no pass
    // of its own over every gradient.
    grad_sumsq_valid_ = false;
    double sumsq = 0.0;
    for (int i = d_.n_layer - 1; i >= 0; i--) {
        if (checkpointing_) layer_forward(i, B, T, false);
        layer_pullback(i, B, T);
        if (fresh) TIMED(forward, kAdamW, sumsq += grad_sum_squares(layer_grad_ranges_[i]));
    }
    // The embedding pullback adds rows into dwte (and dwpe): when writing, they start from
    // zero, except a tied dwte, which the LM head's pullback has just written in full.
    if (writing) {
        if (!d_.tied_embeddings) std::memset(g_.wte, 0, sizeof(float) * (size_t)d_.vocab_size * d);
        if (!d_.rope) std::memset(g_.wpe, 0, sizeof(float) * (size_t)d_.max_seq_len * d);
    }
    const Embedding emb{d};
#ifdef ZOO_CLAD
    if (ad_.clad[kAdEmbedding])
        TIMED(pullback, kEmbedding, emb.pullback_clad(tokens, w_.wte, d_.rope ? nullptr : w_.wpe, a_.d_res, g_.wte,
                                                      d_.rope ? nullptr : g_.wpe, B, T));
    else
#endif
        TIMED(pullback, kEmbedding, emb.pullback(tokens, a_.d_res, g_.wte, d_.rope ? nullptr : g_.wpe, B, T));
    if (fresh) {
        TIMED(forward, kAdamW, sumsq += grad_sum_squares(other_grad_ranges_));
        grad_sumsq_ = sumsq;
        grad_sumsq_valid_ = true;
    }
    return loss;
}

void Executor::zero_grads() {
    grads_consumed_ = true;
    grad_sumsq_valid_ = false;
}

double Executor::grad_norm() const {
    if (grad_sumsq_valid_) return std::sqrt(grad_sumsq_);
    return std::sqrt(grad_sum_squares(all_grads_));
}

void Executor::set_decay_ranges(const std::vector<std::pair<size_t, size_t>>& decayed) {
    for (const auto& r : decayed)
        if (r.first > r.second || r.second > n_params_)
            throw std::invalid_argument("zoo: weight-decay range outside the parameters");
    decay_ranges_ = decayed;
    std::sort(decay_ranges_.begin(), decay_ranges_.end());
}

double Executor::adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                            float max_norm) {
    double t0 = profile.on ? omp_get_wtime() : 0.0;
    double norm = grad_norm();
    float scale = 1.0f;
    if (max_norm > 0 && norm > max_norm) scale = (float)(max_norm / (norm + 1e-6));
    step_count++;
    const AdamW opt{lr, beta1, beta2, eps, weight_decay};
    // Walk [0, n_params) alternating undecayed gaps and decayed ranges.
    size_t at = 0;
    auto run = [&](size_t begin, size_t end, bool decay) {
        if (end > begin)
            opt.update(params() + begin, grads() + begin, adam_m() + begin, adam_v() + begin,
                       end - begin, step_count, decay, scale);
    };
    for (const auto& r : decay_ranges_) {
        run(at, r.first, false);
        run(r.first, r.second, true);
        at = r.second;
    }
    run(at, n_params_, false);
    grads_consumed_ = grads_zero_ = true;  // AdamW::update zeroed every gradient it read
    grad_sumsq_valid_ = false;
    if (profile.on) profile.forward[kAdamW] += omp_get_wtime() - t0;
    return norm;
}

void Executor::reset_cache(int B, int max_len) {
    if (B <= 0 || max_len <= 0) throw std::invalid_argument("zoo: cache shape must be positive");
    if (max_len > d_.max_seq_len)
        throw std::invalid_argument("zoo: generation length " + std::to_string(max_len) +
                                    " exceeds max_seq_len " + std::to_string(d_.max_seq_len));
    const size_t d = d_.d_model, kv = (size_t)d_.n_layer * B * d_.n_kv_head * max_len * d_.head_dim;
    const size_t N = (size_t)B * max_len;  // the prompt may fill the cache in one call
    ArenaPlanner pl;
    size_t o_k = pl.take(kv), o_v = pl.take(kv), o_x = pl.take(N * d), o_n = pl.take(N * d),
           o_s = pl.take(2 * N), o_qkv = pl.take(N * d_.qkv_dim()),
           o_p = pl.take((size_t)B * d_.n_head * max_len * max_len), o_att = pl.take(N * d_.attn_dim()),
           o_fc = pl.take(N * d_.fc_dim()), o_act = pl.take(N * d_.d_ff), o_last = pl.take((size_t)B * d),
           o_lg = pl.take((size_t)B * d_.vocab_size);
    cache_.reset(pl.used);
    float* a = cache_.data;
    k_cache_ = a + o_k; v_cache_ = a + o_v; c_x_ = a + o_x; c_norm_ = a + o_n; c_stat_ = a + o_s;
    c_qkv_ = a + o_qkv; c_probs_ = a + o_p; c_att_ = a + o_att; c_fc_ = a + o_fc; c_act_ = a + o_act;
    c_last_ = a + o_last; c_logits_ = a + o_lg;
    cache_B_ = B;
    cache_len_ = max_len;
}

const float* Executor::forward_cached(const int32_t* tokens, int B, int T, int pos0) {
    if (!k_cache_ || B != cache_B_)
        throw std::invalid_argument("zoo: reset_cache(B, max_len) with this batch size first");
    if (T <= 0 || pos0 < 0 || pos0 + T > cache_len_)
        throw std::invalid_argument("zoo: positions " + std::to_string(pos0) + ".." +
                                    std::to_string(pos0 + T) + " exceed the cache length " +
                                    std::to_string(cache_len_));
    const int N = B * T, d = d_.d_model, V = d_.vocab_size, hd = d_.head_dim;
    for (int n = 0; n < N; n++)
        if (tokens[n] < 0 || tokens[n] >= V)
            throw std::invalid_argument("zoo: token id " + std::to_string(tokens[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
    const Attention attn{d_.n_head, d_.n_kv_head, hd};
    const Linear qkv{d, d_.qkv_dim()}, attn_out{d_.attn_dim(), d}, fc{d, d_.fc_dim()},
        proj{d_.d_ff, d};
    float *mean = c_stat_, *rstd = c_stat_ + N;
    Embedding{d}.forward(tokens, w_.wte, d_.rope ? nullptr : w_.wpe, c_x_, B, T, pos0);
    const size_t layer_kv = (size_t)B * d_.n_kv_head * cache_len_ * hd;
    for (int i = 0; i < d_.n_layer; i++) {
        const LayerWeights& w = w_.layers[i];
        float* kc = k_cache_ + i * layer_kv;
        float* vc = v_cache_ + i * layer_kv;
        norm_forward(c_x_, w.ln1_w, w.ln1_b, c_norm_, mean, rstd, N);
        qkv.forward(c_norm_, w.qkv_w, w.qkv_b, c_qkv_, N);
        if (d_.rope)
            RoPE{hd}.forward(c_qkv_, d_.qkv_dim(), d_.n_head + d_.n_kv_head, rope_cos_.data(),
                             rope_sin_.data(), B, T, pos0);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                for (int g = 0; g < d_.n_kv_head; g++) {
                    const float* row = c_qkv_ + ((size_t)b * T + t) * d_.qkv_dim();
                    size_t at = (((size_t)b * d_.n_kv_head + g) * cache_len_ + pos0 + t) * hd;
                    std::memcpy(kc + at, row + (d_.n_head + g) * hd, sizeof(float) * hd);
                    std::memcpy(vc + at, row + (d_.n_head + d_.n_kv_head + g) * hd, sizeof(float) * hd);
                }
        attn.forward_cached(c_qkv_, kc, vc, c_probs_, c_att_, B, T, pos0, cache_len_);
        attn_out.forward(c_att_, w.attn_out_w, w.attn_out_b, c_x_, N, /*residual=*/c_x_);
        norm_forward(c_x_, w.ln2_w, w.ln2_b, c_norm_, mean, rstd, N);
        fc.forward(c_norm_, w.fc_w, w.fc_b, c_fc_, N);
        activation_forward(c_fc_, c_act_, N);
        proj.forward(c_act_, w.proj_w, w.proj_b, c_x_, N, /*residual=*/c_x_);
    }
    // Only the last position of each sequence needs logits.
    for (int b = 0; b < B; b++)
        std::memcpy(c_last_ + (size_t)b * d, c_x_ + ((size_t)b * T + T - 1) * d, sizeof(float) * d);
    norm_forward(c_last_, w_.lnf_w, w_.lnf_b, c_norm_, mean, rstd, B);
    Linear{d, V}.forward(c_norm_, head_weight(), nullptr, c_logits_, B);
    return c_logits_;
}

}  // namespace zoo
