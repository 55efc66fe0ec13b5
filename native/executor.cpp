#include <omp.h>

#include <algorithm>

#include "model.hpp"

namespace zoo {

Executor::Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& bindings,
                   const std::vector<float>& inv_freq)
    : d_(dims), n_params_(n_params) {
    store_.reset(4 * n_params_);
    w_.layers.resize(d_.n_layer);
    g_.layers.resize(d_.n_layer);
    bind(w_, params(), bindings);
    bind(g_, grads(), bindings);
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

size_t Executor::activation_floats(int B, int T) const {
    ArenaPlanner pl;
    size_t N = (size_t)B * T, d = d_.d_model;
    pl.take((d_.n_layer + 1) * N * d);
    for (int l = 0; l < d_.n_layer; l++) {
        pl.take(N * d); pl.take(N); pl.take(N);
        pl.take(N * d_.qkv_dim());
        pl.take((size_t)B * d_.n_head * T * T);
        pl.take(N * d_.attn_dim());
        pl.take(N * d);
        pl.take(N * d); pl.take(N); pl.take(N);
        pl.take(N * d_.fc_dim());
        pl.take(N * d_.d_ff);
    }
    pl.take(N * d); pl.take(N); pl.take(N);
    pl.take(N * d_.vocab_size);
    pl.take(N);
    pl.take(N * d); pl.take(N * d); pl.take(N * d_.qkv_dim()); pl.take(N * d_.attn_dim());
    pl.take(N * d_.fc_dim()); pl.take(N * d_.d_ff);
    pl.take((size_t)omp_get_max_threads() * T);
    return pl.used;
}

void Executor::plan(int B, int T) {
    if (B <= 0 || T <= 0) throw std::invalid_argument("zoo: batch and sequence length must be positive");
    if (T > d_.max_seq_len)
        throw std::invalid_argument("zoo: sequence length " + std::to_string(T) +
                                    " exceeds max_seq_len " + std::to_string(d_.max_seq_len));
    B_ = B;
    T_ = T;
    if (B <= cap_B_ && T == cap_T_) return;  // the layout depends on T (probs are T x T)
    acts_.reset(activation_floats(B, T));
    cap_B_ = B;
    cap_T_ = T;
    ArenaPlanner pl;
    float* a = acts_.data;
    size_t N = (size_t)B * T, d = d_.d_model;
    auto take = [&](size_t n) { return a + pl.take(n); };
    residual_ = take((d_.n_layer + 1) * N * d);
    la_.resize(d_.n_layer);
    for (auto& l : la_) {
        l.ln1 = take(N * d); l.ln1_mean = take(N); l.ln1_rstd = take(N);
        l.qkv = take(N * d_.qkv_dim());
        l.probs = take((size_t)B * d_.n_head * T * T);
        l.att = take(N * d_.attn_dim());
        l.res_mid = take(N * d);
        l.ln2 = take(N * d); l.ln2_mean = take(N); l.ln2_rstd = take(N);
        l.fc = take(N * d_.fc_dim());
        l.act = take(N * d_.d_ff);
    }
    lnf_ = take(N * d); lnf_mean_ = take(N); lnf_rstd_ = take(N);
    logits_ = take(N * d_.vocab_size);
    row_loss_ = take(N);
    d_res_ = take(N * d); d_norm_ = take(N * d); d_qkv_ = take(N * d_.qkv_dim());
    d_att_ = take(N * d_.attn_dim()); d_fc_ = take(N * d_.fc_dim()); d_act_ = take(N * d_.d_ff);
    attn_scratch_ = take((size_t)omp_get_max_threads() * T);
    tokens_.resize(N);
    targets_.resize(N);
}

void Executor::norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                            float* rstd, int N) const {
    if (d_.norm == NormKind::layernorm)
        LayerNorm{d_.d_model, d_.norm_eps}.forward(x, w, b, y, mean, rstd, N);
    else
        RMSNorm{d_.d_model, d_.norm_eps}.forward(x, w, y, rstd, N);
}

void Executor::norm_pullback(const float* x, const float* w, const float* mean, const float* rstd,
                             const float* dy, float* dx, float* dw, float* db, int N) const {
    if (d_.norm == NormKind::layernorm)
        LayerNorm{d_.d_model, d_.norm_eps}.pullback(x, w, mean, rstd, dy, dx, dw, db, N);
    else
        RMSNorm{d_.d_model, d_.norm_eps}.pullback(x, w, rstd, dy, dx, dw, N);
}

double Executor::forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
    plan(B, T);
    const int N = B * T, d = d_.d_model, V = d_.vocab_size;
    for (int n = 0; n < N; n++) {
        if (tokens[n] < 0 || tokens[n] >= V)
            throw std::invalid_argument("zoo: token id " + std::to_string(tokens[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
        if (targets && targets[n] != CrossEntropy::ignore_index && (targets[n] < 0 || targets[n] >= V))
            throw std::invalid_argument("zoo: target id " + std::to_string(targets[n]) +
                                        " outside the vocabulary [0, " + std::to_string(V) + ")");
    }
    std::copy(tokens, tokens + N, tokens_.begin());
    have_targets_ = targets != nullptr;
    if (targets) std::copy(targets, targets + N, targets_.begin());

    Embedding{d}.forward(tokens, w_.wte, d_.rope ? nullptr : w_.wpe, residual_, B, T);
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv{d, d_.qkv_dim()}, attn_out{d_.attn_dim(), d}, fc{d, d_.fc_dim()},
        proj{d_.d_ff, d};
    for (int i = 0; i < d_.n_layer; i++) {
        const LayerWeights& w = w_.layers[i];
        LayerActs& a = la_[i];
        const float* x = residual_ + (size_t)i * N * d;
        float* x_out = residual_ + (size_t)(i + 1) * N * d;
        norm_forward(x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_mean, a.ln1_rstd, N);
        qkv.forward(a.ln1, w.qkv_w, w.qkv_b, a.qkv, N);
        if (d_.rope)  // q and k heads are adjacent: rotate n_head + n_kv_head heads per row
            RoPE{d_.head_dim}.forward(a.qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head,
                                      rope_cos_.data(), rope_sin_.data(), B, T);
        attn.forward(a.qkv, a.probs, a.att, B, T);
        std::memcpy(a.res_mid, x, sizeof(float) * N * d);
        attn_out.forward(a.att, w.attn_out_w, w.attn_out_b, a.res_mid, N, /*accumulate=*/true);
        norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_mean, a.ln2_rstd, N);
        fc.forward(a.ln2, w.fc_w, w.fc_b, a.fc, N);
        if (d_.mlp == MlpKind::swiglu)
            SwiGLU{d_.d_ff}.forward(a.fc, a.act, N);
        else
            GELU{d_.d_ff}.forward(a.fc, a.act, N);
        std::memcpy(x_out, a.res_mid, sizeof(float) * N * d);
        proj.forward(a.act, w.proj_w, w.proj_b, x_out, N, /*accumulate=*/true);
    }
    norm_forward(residual_ + (size_t)d_.n_layer * N * d, w_.lnf_w, w_.lnf_b, lnf_, lnf_mean_,
                 lnf_rstd_, N);
    Linear{d, V}.forward(lnf_, head_weight(), nullptr, logits_, N);
    if (!targets) return NAN;
    return CrossEntropy{V}.forward(logits_, targets, row_loss_, N, &n_valid_);
}

void Executor::backward(float grad_scale) {
    if (!have_targets_) throw std::logic_error("zoo: backward needs a forward with targets");
    have_targets_ = false;  // the logits are consumed below
    const int B = B_, T = T_, N = B * T, d = d_.d_model, V = d_.vocab_size;
    const Attention attn{d_.n_head, d_.n_kv_head, d_.head_dim};
    const Linear qkv{d, d_.qkv_dim()}, attn_out{d_.attn_dim(), d}, fc{d, d_.fc_dim()},
        proj{d_.d_ff, d};

    CrossEntropy{V}.pullback(logits_, targets_.data(), N, n_valid_, grad_scale);
    float* dlogits = logits_;
    Linear{d, V}.pullback(lnf_, head_weight(), dlogits, d_norm_, head_grad(), nullptr, N);
    std::memset(d_res_, 0, sizeof(float) * N * d);
    norm_pullback(residual_ + (size_t)d_.n_layer * N * d, w_.lnf_w, lnf_mean_, lnf_rstd_, d_norm_,
                  d_res_, g_.lnf_w, g_.lnf_b, N);
    for (int i = d_.n_layer - 1; i >= 0; i--) {
        const LayerWeights& w = w_.layers[i];
        LayerWeights& g = g_.layers[i];
        LayerActs& a = la_[i];
        const float* x = residual_ + (size_t)i * N * d;
        // d_res holds dL/d(layer output) = dL/d(res_mid) through the MLP's residual path.
        proj.pullback(a.act, w.proj_w, d_res_, d_act_, g.proj_w, g.proj_b, N);
        if (d_.mlp == MlpKind::swiglu)
            SwiGLU{d_.d_ff}.pullback(a.fc, d_act_, d_fc_, N);
        else
            GELU{d_.d_ff}.pullback(a.fc, d_act_, d_fc_, N);
        fc.pullback(a.ln2, w.fc_w, d_fc_, d_norm_, g.fc_w, g.fc_b, N);
        norm_pullback(a.res_mid, w.ln2_w, a.ln2_mean, a.ln2_rstd, d_norm_, d_res_, g.ln2_w,
                      g.ln2_b, N);
        // d_res now holds dL/d(res_mid) = dL/d(layer input) through the attention residual.
        attn_out.pullback(a.att, w.attn_out_w, d_res_, d_att_, g.attn_out_w, g.attn_out_b, N);
        attn.pullback(a.qkv, a.probs, d_att_, d_qkv_, attn_scratch_, B, T);
        if (d_.rope)
            RoPE{d_.head_dim}.pullback(d_qkv_, d_.qkv_dim(), d_.n_head + d_.n_kv_head,
                                       rope_cos_.data(), rope_sin_.data(), B, T);
        qkv.pullback(a.ln1, w.qkv_w, d_qkv_, d_norm_, g.qkv_w, g.qkv_b, N);
        norm_pullback(x, w.ln1_w, a.ln1_mean, a.ln1_rstd, d_norm_, d_res_, g.ln1_w, g.ln1_b, N);
    }
    Embedding{d}.pullback(tokens_.data(), d_res_, g_.wte, d_.rope ? nullptr : g_.wpe, B, T);
}

double Executor::grad_norm() const {
    const float* g = store_.data + n_params_;
    const long n = (long)n_params_;
    double total = 0.0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (long i = 0; i < n; i++) total += (double)g[i] * g[i];
    return std::sqrt(total);
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
    cache_T_cap_ = max_len;
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
        attn_out.forward(c_att_, w.attn_out_w, w.attn_out_b, c_x_, N, /*accumulate=*/true);
        norm_forward(c_x_, w.ln2_w, w.ln2_b, c_norm_, mean, rstd, N);
        fc.forward(c_norm_, w.fc_w, w.fc_b, c_fc_, N);
        if (d_.mlp == MlpKind::swiglu)
            SwiGLU{d_.d_ff}.forward(c_fc_, c_act_, N);
        else
            GELU{d_.d_ff}.forward(c_fc_, c_act_, N);
        proj.forward(c_act_, w.proj_w, w.proj_b, c_x_, N, /*accumulate=*/true);
    }
    // Only the last position of each sequence needs logits.
    for (int b = 0; b < B; b++)
        std::memcpy(c_last_ + (size_t)b * d, c_x_ + ((size_t)b * T + T - 1) * d, sizeof(float) * d);
    norm_forward(c_last_, w_.lnf_w, w_.lnf_b, c_norm_, mean, rstd, B);
    Linear{d, V}.forward(c_norm_, head_weight(), nullptr, c_logits_, B);
    return c_logits_;
}

}  // namespace zoo
