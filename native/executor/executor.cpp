#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/bf16.hpp"
#include "kernels/gemv.hpp"
#include "layers/layers.hpp"

namespace zoo {

// Runs the statement, adding its wall time to profile.<dir>[k_<slot>] when profiling is on.
#define TIMED(dir, slot, ...)                                          \
    do {                                                               \
        double t0_ = profile.on ? Profile::now() : 0.0;                \
        __VA_ARGS__;                                                   \
        if (profile.on) profile.dir[k_##slot] += Profile::now() - t0_; \
    } while (0)

Executor::Executor(const Dims& dims, size_t n_params, const std::vector<ParamBinding>& layout,
                   const std::vector<FrozenBinding>& frozen, const std::vector<AdapterBinding>& adapters,
                   const std::vector<float>& inv_freq, const std::vector<float>& inv_freq_local)
    : d_(dims), n_params_(n_params), layout_(layout) {
    check_dims(d_);  // before any table is sized from the config
    d_.layer_window.resize(d_.n_layer, 0);  // (a Dims made in C++ may leave the per-layer lists empty)
    d_.layer_rope.resize(d_.n_layer, 1);
    if (d_.frozen == frozen.empty())
        throw std::invalid_argument(d_.frozen ? "zoo: a frozen base needs the table of its tensors"
                                              : "zoo: a table of frozen tensors, but the base trains");
    if (!d_.frozen && (!adapters.empty() || d_.lora_width))
        throw std::invalid_argument("zoo: LoRA adapters sit on a frozen base; this base trains");
    if (d_.layer->parallel && d_.variant())  // its block calls compute the Llama layer's blocks only
        throw std::invalid_argument(std::string("zoo: layer='") + d_.layer->name +
                                    "' computes none of q/k norms, post-branch norms, windows, NoPE layers or the "
                                    "attention, embedding and residual scales");
    if (d_.lora_dropout < 0.0f || !(d_.lora_dropout < 1.0f))
        throw std::invalid_argument("zoo: lora dropout must be in [0, 1)");
    plan_grad_ranges(layout, adapters);  // checks the tables before anything is bound
    params_.reset(n_params_, "trainable weights");
    moment_end_ = n_params_;
    if (d_.frozen) {
        bind_frozen(frozen);
        frozen_grad_sink_.resize(2 * (size_t)d_.widest_input());
    } else {
        bind(w_, params(), layout);
    }
    g_.layers.resize(d_.n_layer);  // bound when the gradients are mapped (a frozen base's stay null)
    bind_matrices();
    bind_adapters(adapters);
    if (d_.rope) {
        const size_t half = d_.rotary_half();
        const bool local = std::count(d_.layer_rope.begin(), d_.layer_rope.end(), 2) > 0;
        if (inv_freq.size() != half || (local && inv_freq_local.size() != half) || (!local && !inv_freq_local.empty()))
            throw std::invalid_argument("zoo: inv_freq (and inv_freq_local, exactly where layers use the local table) "
                                        "must have rotary_dim/2 = " + std::to_string(half) + " entries");
        // The tables grow with the longest row a pass plans (ensure_rope), not to max_seq_len
        // at once: 32 MiB for a 128K-position Llama, which a 1K-token step never reads.
        rope_inv_freq_ = inv_freq;
        if (local) local_inv_freq_ = inv_freq_local;
    }
    set_clad_blocks({});
}

// RoPE tables for positions [0, len) at least (len <= max_seq_len), built the first time a pass
// needs them and rebuilt longer (doubling, to max_seq_len) when a longer one comes.
void Executor::ensure_rope(int len) {
    if (!d_.rope || len <= rope_len_) return;
    len = std::min(d_.max_seq_len, std::max(len, 2 * rope_len_));
    const size_t n = (size_t)len * d_.rotary_half();
    rope_cos_.resize(n);
    rope_sin_.resize(n);
    rope().build_tables(rope_inv_freq_.data(), rope_cos_.data(), rope_sin_.data(), len);
    if (!local_inv_freq_.empty()) {
        local_cos_.resize(n);
        local_sin_.resize(n);
        rope().build_tables(local_inv_freq_.data(), local_cos_.data(), local_sin_.data(), len);
    }
    rope_len_ = len;
}

// The linear layers adapters sit on: input and output widths.
static LoraSlot slot_named(const std::string& name) {
#define ZOO_MATCH_SLOT(s) \
    if (name == #s) return lora_##s;
    ZOO_LORA_SLOTS(ZOO_MATCH_SLOT)
#undef ZOO_MATCH_SLOT
    throw std::invalid_argument("zoo: no linear layer '" + name + "' for an adapter (qkv, attn_out, fc, proj)");
}
static int slot_in(const Dims& d, LoraSlot s) {
    return s == lora_attn_out ? d.attn_dim() : s == lora_proj ? d.d_ff : d.d_model;
}
static int slot_out(const Dims& d, LoraSlot s) {
    return s == lora_qkv ? d.qkv_dim() : s == lora_fc ? d.fc_dim() : d.d_model;
}
static size_t slot_input(const Dims& d, const std::string& slot) { return slot_in(d, slot_named(slot)); }

// The table must tile the parameter arena exactly (no gap: a gradient no pullback writes; no
// overlap: two tensors in one place). Each layer's ranges, adjacent ones merged, let a step
// take a layer's gradient norm while it is in cache.
void Executor::plan_grad_ranges(const std::vector<ParamBinding>& layout, const std::vector<AdapterBinding>& adapters) {
    std::vector<Range> all;
    std::vector<std::vector<Range>> by_layer(d_.n_layer + 1);  // the last: outside the layers
    std::vector<ParamBinding> rows = layout;
    for (const auto& a : adapters) {  // A and B as rows of their own; bind_adapters checks their sizes
        if (a.rank <= 0 || a.o1 <= a.o0)
            throw std::invalid_argument("zoo: adapter on " + a.slot + " in layer " + std::to_string(a.layer) +
                                        " has rank " + std::to_string(a.rank) + " and columns [" +
                                        std::to_string(a.o0) + ", " + std::to_string(a.o1) + ")");
        rows.push_back({a.slot + " adapter A", a.layer, a.a_offset, (size_t)a.rank * slot_input(d_, a.slot)});
        rows.push_back({a.slot + " adapter B", a.layer, a.b_offset, (size_t)a.rank * (a.o1 - a.o0)});
    }
    for (const auto& b : rows) {
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
    if ((role == "ln1_w" || role == "ln2_w" || role == "ln1_b" || role == "ln2_b") && !d.pre_norm) return 0;
    if (role == "ln1_w" || role == "ln2_w" || role == "lnf_w") return D;
    if (role == "ln1_b" || role == "ln2_b" || role == "lnf_b") return d.norm->bias ? D : 0;
    if (role == "qkv_w") return (size_t)d.qkv_dim() * D;
    if (role == "qkv_b") return d.attention_bias ? d.qkv_dim() : 0;
    if (role == "attn_out_w") return D * d.attn_dim();
    if (role == "attn_out_b") return d.attention_out_bias ? D : 0;
    const size_t qk_width = d.qk_norm == 1 ? d.head_dim : 0;
    if (role == "q_norm_w") return d.qk_norm ? (qk_width ? qk_width : (size_t)d.attn_dim()) : 0;
    if (role == "k_norm_w") return d.qk_norm ? (qk_width ? qk_width : (size_t)d.n_kv_head * d.head_dim) : 0;
    if (role == "post_attn_w" || role == "post_mlp_w") return d.post_norm ? D : 0;
    if (role == "post_attn_b" || role == "post_mlp_b") return d.post_norm && d.norm->bias ? D : 0;
    if (role == "fc_w") return (size_t)d.fc_dim() * D;
    if (role == "fc_b") return d.mlp_bias ? d.fc_dim() : 0;
    if (role == "proj_w") return D * d.d_ff;
    if (role == "proj_b") return d.mlp_bias ? D : 0;
    return 0;
}

// The field a role binds to in t (layer < 0: the model's own), or null for no such role.
static float** role_slot(ModelTensors& t, const std::string& role, int layer) {
#define ZOO_MATCH_ROLE(r) \
    if (role == #r) return &tensors.r;
    if (layer < 0) {
        ModelTensors& tensors = t;
        ZOO_MODEL_ROLES(ZOO_MATCH_ROLE)
    } else {
        LayerTensors& tensors = t.layers[layer];
        ZOO_LAYER_ROLES(ZOO_MATCH_ROLE)
    }
#undef ZOO_MATCH_ROLE
    return nullptr;
}
static Matrix* matrix_slot(ModelMatrices& m, const std::string& role, int layer) {
#define ZOO_MATCH_MATRIX(r) \
    if (role == #r) return &matrices.r;
    if (layer < 0) {
        ModelMatrices& matrices = m;
        ZOO_MODEL_MATRICES(ZOO_MATCH_MATRIX)
    } else {
        LayerMatrices& matrices = m.layers[layer];
        ZOO_LAYER_MATRICES(ZOO_MATCH_MATRIX)
    }
#undef ZOO_MATCH_MATRIX
    return nullptr;
}
// A matrix role's (rows, cols): (out, in) of its products; the token embedding's (vocab, d).
static std::pair<int, int> matrix_shape(const Dims& d, const std::string& role) {
    if (role == "wte" || role == "lm_head_w") return {d.vocab_size, d.d_model};
    if (role == "qkv_w") return {d.qkv_dim(), d.d_model};
    if (role == "attn_out_w") return {d.d_model, d.attn_dim()};
    if (role == "fc_w") return {d.fc_dim(), d.d_model};
    return {d.d_model, d.d_ff};  // proj_w
}

static std::string where(const std::string& role, int layer) {
    return role + (layer < 0 ? " outside the layers" : " in layer " + std::to_string(layer));
}

// The layout table bound in one loop: each row's pointer goes to its role's field.
void Executor::bind(ModelTensors& t, float* base, const std::vector<ParamBinding>& layout) const {
    t = ModelTensors{};
    t.layers.resize(d_.n_layer);
    for (const auto& b : layout) {
        float** slot = role_slot(t, b.role, b.layer);
        const std::string at = where(b.role, b.layer);
        if (!slot) throw std::invalid_argument("zoo: no parameter role " + at);
        if (*slot) throw std::invalid_argument("zoo: parameter role " + at + " is bound twice");
        const size_t read = kernel_floats(d_, b.role);
        if (read == 0)
            throw std::invalid_argument("zoo: parameter role " + at + " is bound, but the config has no such tensor");
        if (b.count != read)
            throw std::invalid_argument("zoo: parameter role " + at + " has " + std::to_string(b.count) +
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

// A frozen base: its tensors placed in table order in the base arena, each in its format (only
// the matrix roles may be narrower than fp32), the vectors bound into w_, the matrices into wm_.
void Executor::bind_frozen(const std::vector<FrozenBinding>& frozen) {
    size_t at = 0;
    for (const auto& f : frozen) {
        limits::check_size(("rows x cols of " + where(f.role, f.layer)).c_str(), (int64_t)(f.rows * f.cols),
                           limits::max_tensor_floats);
        base_offsets_.push_back(at);
        at += storage_bytes(f.dtype, f.rows, f.cols);
    }
    base_.reset((at + 3) / 4, "frozen base");
    base_rows_ = frozen;
    base_files_.clear();
    base_files_.resize(frozen.size());
    w_ = ModelTensors{};
    w_.layers.resize(d_.n_layer);
    wm_ = ModelMatrices{};
    wm_.layers.resize(d_.n_layer);
    for (size_t k = 0; k < frozen.size(); k++) {
        const FrozenBinding& f = frozen[k];
        const std::string at_role = where(f.role, f.layer);
        if (f.layer < -1 || f.layer >= d_.n_layer)
            throw std::invalid_argument("zoo: frozen tensor " + at_role + " outside the layers");
        float** slot = role_slot(w_, f.role, f.layer);
        if (!slot) throw std::invalid_argument("zoo: no parameter role " + at_role);
        const size_t read = kernel_floats(d_, f.role);
        if (read == 0)
            throw std::invalid_argument("zoo: frozen tensor " + at_role + " is bound, but the config has no such tensor");
        if (f.rows * f.cols != read)
            throw std::invalid_argument("zoo: frozen tensor " + at_role + " has " + std::to_string(f.rows * f.cols) +
                                        " values; the kernels read " + std::to_string(read));
        void* data = reinterpret_cast<uint8_t*>(base_.data) + base_offsets_[k];
        if (Matrix* m = matrix_slot(wm_, f.role, f.layer)) {
            const auto [rows, cols] = matrix_shape(d_, f.role);
            if ((int)f.rows != rows || (int)f.cols != cols)
                throw std::invalid_argument("zoo: frozen matrix " + at_role + " is " + std::to_string(f.rows) + " x " +
                                            std::to_string(f.cols) + "; the products read " + std::to_string(rows) +
                                            " x " + std::to_string(cols));
            if (m->data) throw std::invalid_argument("zoo: parameter role " + at_role + " is bound twice");
            *m = Matrix(data, f.dtype, rows, cols);
        } else {
            if (f.dtype != DType::f32)
                throw std::invalid_argument("zoo: frozen tensor " + at_role + " is stored in fp32 only (a vector, or "
                                            "an embedding read row by row), not " + dtype_name(f.dtype));
            if (*slot) throw std::invalid_argument("zoo: parameter role " + at_role + " is bound twice");
            *slot = static_cast<float*>(data);
        }
    }
    auto need = [&](bool bound, const char* role, int layer) {
        if (!bound && kernel_floats(d_, role))
            throw std::invalid_argument(std::string("zoo: frozen tensor ") + where(role, layer) + " is not bound");
    };
#define ZOO_IS_MATRIX(r) || role == #r
    auto bound = [&](const std::string& role, int layer) {
        if (false ZOO_MODEL_MATRICES(ZOO_IS_MATRIX) ZOO_LAYER_MATRICES(ZOO_IS_MATRIX))
            return matrix_slot(wm_, role, layer)->data != nullptr;
        return *role_slot(w_, role, layer) != nullptr;
    };
#undef ZOO_IS_MATRIX
#define ZOO_NEED_MODEL(r) need(bound(#r, -1), #r, -1);
    ZOO_MODEL_ROLES(ZOO_NEED_MODEL)
#undef ZOO_NEED_MODEL
    for (int i = 0; i < d_.n_layer; i++) {
#define ZOO_NEED_LAYER(r) need(bound(#r, i), #r, i);
        ZOO_LAYER_ROLES(ZOO_NEED_LAYER)
#undef ZOO_NEED_LAYER
    }
}

// A trainable base's matrices: fp32 views of its weights.
void Executor::bind_matrices() {
    if (d_.frozen) return;  // bind_frozen placed them
    wm_ = ModelMatrices{};
    wm_.layers.resize(d_.n_layer);
    auto view = [&](Matrix& m, float* w, const char* role) {
        const auto [rows, cols] = matrix_shape(d_, role);
        if (w) m = Matrix(w, DType::f32, rows, cols);
    };
#define ZOO_VIEW_MODEL(r) view(wm_.r, w_.r, #r);
    ZOO_MODEL_MATRICES(ZOO_VIEW_MODEL)
#undef ZOO_VIEW_MODEL
    for (int i = 0; i < d_.n_layer; i++) {
#define ZOO_VIEW_LAYER(r) view(wm_.layers[i].r, w_.layers[i].r, #r);
        ZOO_LAYER_MATRICES(ZOO_VIEW_LAYER)
#undef ZOO_VIEW_LAYER
    }
}

// The adapters grouped by layer and slot; a slot's in order of their columns, with their A's
// and their B's adjacent, so that one product serves all of a slot's A's.
void Executor::bind_adapters(const std::vector<AdapterBinding>& adapters) {
    adapters_.assign(d_.n_layer, {});
    for (const auto& a : adapters) {
        const LoraSlot slot = slot_named(a.slot);
        const std::string at = "adapter on " + a.slot + " in layer " + std::to_string(a.layer);
        if (a.layer < 0 || a.layer >= d_.n_layer) throw std::invalid_argument("zoo: " + at + ": no such layer");
        if (a.o0 < 0 || a.o1 > slot_out(d_, slot))
            throw std::invalid_argument("zoo: " + at + ": columns [" + std::to_string(a.o0) + ", " +
                                        std::to_string(a.o1) + ") outside the layer's " +
                                        std::to_string(slot_out(d_, slot)));
        SlotAdapters& s = adapters_[a.layer][slot];
        if (s.n_seg == 0) {
            s.rank = a.rank;
            s.a_offset = a.a_offset;
            s.b_offset = a.b_offset;
        } else {
            const size_t a_at = s.a_offset + (size_t)s.n_seg * s.rank * slot_in(d_, slot);
            const size_t b_at = s.b_offset + lora_b_offset(s.seg.data(), s.n_seg, s.rank);
            if (a.rank != s.rank) throw std::invalid_argument("zoo: " + at + ": one rank per layer's slot");
            if (a.o0 < s.seg.back()) throw std::invalid_argument("zoo: " + at + ": columns overlap or out of order");
            if (a.a_offset != a_at || a.b_offset != b_at)
                throw std::invalid_argument("zoo: " + at + ": its A and B must follow the slot's previous ones");
        }
        s.seg.push_back(a.o0);
        s.seg.push_back(a.o1);
        s.n_seg++;
        has_adapters_ = true;
        if (s.n_seg * s.rank > d_.lora_width)
            throw std::invalid_argument("zoo: " + at + ": the slot's adapters are " + std::to_string(s.n_seg * s.rank) +
                                        " wide; the plan was sized for " + std::to_string(d_.lora_width));
    }
    point_adapters();
}

void Executor::point_adapters() {
    float* g = grads_arena_.data;
    for (auto& layer : adapters_)
        for (SlotAdapters& s : layer) {
            if (!s.n_seg) continue;
            s.A = params() + s.a_offset;
            s.B = params() + s.b_offset;
            s.dA = g ? g + s.a_offset : nullptr;
            s.dB = g ? g + s.b_offset : nullptr;
        }
}

float* Executor::grads() {
    if (!grads_arena_.data && n_params_) {
        grads_arena_.reset(n_params_, "gradients");
        if (!d_.frozen) bind(g_, grads_arena_.data, layout_);
        point_adapters();
    }
    return grads_arena_.data;
}

const FrozenBinding& Executor::base_binding(size_t index) const {
    if (index >= base_rows_.size())
        throw std::out_of_range("zoo: the frozen base has " + std::to_string(base_rows_.size()) + " tensors, not " +
                                std::to_string(index + 1));
    return base_rows_[index];
}

void Executor::store_base(size_t index, size_t first_row, size_t rows, const float* values) {
    const FrozenBinding& f = base_binding(index);
    if (first_row + rows > f.rows) throw std::invalid_argument("zoo: rows outside frozen tensor " + where(f.role, f.layer));
    store_rows(f.dtype, (int)f.rows, (int)f.cols, (int)first_row, (int)rows, values, base_data(index));
    if (const Matrix* m = matrix_slot(wm_, f.role, f.layer); m && m->packed_xw) packed_stale_ = true;
}

void Executor::map_base(size_t index, const std::string& path, size_t offset, const std::string& what) {
    const FrozenBinding& f = base_binding(index);
    Matrix* m = matrix_slot(wm_, f.role, f.layer);
    if (!m) throw std::invalid_argument("zoo: " + what + " (" + where(f.role, f.layer) + ") is not a matrix; only "
                                        "matrices map from a file");
    if (f.dtype != DType::f32 && f.dtype != DType::bf16)
        throw std::invalid_argument("zoo: " + what + " is stored as " + dtype_name(f.dtype) + " in this base; only "
                                    "fp32 and bf16 tensors map from a file as they are");
    const size_t bytes = value_bytes(f.dtype, f.rows, f.cols);
    if (offset % (f.dtype == DType::f32 ? 4 : 2))
        throw std::invalid_argument("zoo: " + path + ": " + what + " starts at byte " + std::to_string(offset) +
                                    ", not aligned to its values");
    auto mapping = std::make_unique<FileMapping>();
    mapping->map(path, offset, bytes, what);
    m->data = mapping->data;
    base_files_[index] = std::move(mapping);
    if (m->packed_xw) packed_stale_ = true;
    // The arena's pages for the tensor, if anything was stored there, go back to the system.
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(base_.data) + base_offsets_[index];
    const uintptr_t first = (begin + page - 1) / page * page, last = (begin + bytes) / page * page;
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// The frozen bf16 matrices an input gradient reads: the layers' and the LM head's (a tied
// embedding, or its own).
std::vector<Matrix*> Executor::packable_matrices() {
    std::vector<Matrix*> out;
    if (!d_.frozen) return out;
    auto take = [&](Matrix& m) {
        if (m.data && m.dtype == DType::bf16) out.push_back(&m);
    };
    for (LayerMatrices& l : wm_.layers) {
#define ZOO_TAKE_LAYER(r) take(l.r);
        ZOO_LAYER_MATRICES(ZOO_TAKE_LAYER)
#undef ZOO_TAKE_LAYER
    }
    take(d_.tied_embeddings ? wm_.wte : wm_.lm_head_w);
    return out;
}

size_t Executor::packed_base_bytes() {
    size_t total = 0;
    for (Matrix* m : packable_matrices()) total += gemm::packed_xw_bytes(*m);
    return total;
}

size_t Executor::set_packed_base(bool on) {
    for (Matrix* m : packable_matrices()) m->packed_xw = nullptr;
    packed_.reset(0, "packed base");
    packed_on_ = packed_stale_ = false;
    if (!on) return 0;
    size_t total = 0;
    std::vector<std::pair<Matrix*, size_t>> placed;
    for (Matrix* m : packable_matrices())
        if (const size_t bytes = gemm::packed_xw_bytes(*m)) {
            placed.push_back({m, total});
            total += bytes;  // 64-byte multiples
        }
    if (!total) return 0;
    packed_.reset((total + 3) / 4, "packed base");
    for (auto [m, at] : placed) m->packed_xw = reinterpret_cast<uint8_t*>(packed_.data) + at;
    packed_on_ = true;
    repack_base();
    return total;
}

void Executor::repack_base() {
    try {
        for (Matrix* m : packable_matrices())
            if (m->packed_xw) gemm::pack_xw(*m, const_cast<void*>(m->packed_xw));
    } catch (...) {
        set_packed_base(false);  // a copy packed in part must not be read
        throw;
    }
    packed_stale_ = false;
}

size_t Executor::mapped_base_bytes() const {
    size_t n = 0;
    for (size_t k = 0; k < base_files_.size(); k++)
        if (base_files_[k]) n += value_bytes(base_rows_[k].dtype, base_rows_[k].rows, base_rows_[k].cols);
    return n;
}

void Executor::load_base(size_t index, size_t first_row, size_t rows, float* values) const {
    const FrozenBinding& f = base_binding(index);
    if (first_row + rows > f.rows) throw std::invalid_argument("zoo: rows outside frozen tensor " + where(f.role, f.layer));
    const Matrix m(base_data(index), f.dtype, (int)f.rows, (int)f.cols);
    widen_rows(m, (int)first_row, (int)(first_row + rows), values);
}

std::vector<std::pair<std::string, size_t>> Executor::arena_bytes() const {
    const size_t mapped = mapped_base_bytes();
    return {{"weights", 4 * params_.size},     {"frozen_base", 4 * base_.size - mapped},
            {"frozen_base_mapped", mapped},    {"packed_base", 4 * packed_.size},
            {"gradients", 4 * grads_arena_.size},
            {"moments", 4 * moments_.size},    {"activations", 4 * acts_.size},  {"kv_cache", 4 * cache_.size},
            {"logits", 4 * logits_arena_.size}};
}

// Sum of squares of the gradients in ranges: float blocks of 1024 (vectorized), their sums
// in double. One parallel region; each thread takes its static share of every range.
double Executor::grad_sum_squares(const std::vector<Range>& ranges) const {
    const float* g = grads_arena_.data;
    double total = 0.0;
    if (!g) return 0.0;
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
// docs/benchmarks.md). Over a frozen base (whose head weight is widened or repacked for every
// chunk, and whose activations are small next to it) a chunk takes 16M floats, with or without
// checkpointing: llama-3.1-8b at 1 x 256 in two chunks, not eight, and llama-3.2-1b in two, not
// one (its peak memory is the target there). Evened out so the last chunk is not a sliver.
static int head_chunk_rows(size_t N, int V, bool checkpointing, Precision precision, bool frozen, size_t dead_floats,
                           size_t live_floats) {
    const size_t budget = std::max<size_t>(checkpointing ? 4u << 20 : 8u << 20, dead_floats);
    size_t max_rows = std::max<size_t>(checkpointing ? 16 : 1024, budget / V);
    if (precision == Precision::bf16 && !checkpointing && !frozen)
        max_rows = std::min(max_rows, std::max<size_t>(16, std::max(budget, live_floats / 2) / V));
    if (frozen) max_rows = std::max<size_t>(16, (size_t(16) << 20) / V);  // 64 MiB of logits
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
    if (d.qk_norm)  // the norm over q's width (at least k's)
        n = std::max(n, need(ad.on(d.norm->name) ? d.norm->clad_scratch_floats : d.norm->scratch_floats,
                             d.qk_norm == 1 ? d.head_dim : d.attn_dim()));
    n = std::max(n, ad.on("attention") ? attn.clad_scratch_floats(threads, T) : attn.pullback_scratch_floats(threads, T));
    if (ad.on("linear")) {  // the replayed bias add of the widest layer with a bias
        int widest = 0;
        if (d.attention_bias) widest = d.qkv_dim();
        if (d.attention_out_bias) widest = std::max(widest, d.d_model);
        if (d.mlp_bias) widest = std::max({widest, d.fc_dim(), d.d_model});
        n = std::max(n, Linear{0, widest}.clad_scratch_floats(B * T));  // B * T: check_batch bounds it
    }
    return n;
}

// A frozen base's products over M rows: the most scratch any of its matrices needs (quant.hpp).
static size_t matrix_scratch_floats(const Dims& d, Precision p, size_t M) {
    if (!d.frozen || d.matrix_dtype == DType::f32) return 0;
    const std::pair<int, int> shapes[] = {{d.qkv_dim(), d.d_model}, {d.d_model, d.attn_dim()}, {d.fc_dim(), d.d_model},
                                          {d.d_model, d.d_ff},       {d.vocab_size, d.d_model}};
    size_t n = 0;
    for (const auto& [rows, cols] : shapes) n = std::max(n, gemm::matrix_scratch_floats(p, d.matrix_dtype, (int)M, rows, cols));
    return n;
}
// The adapters' scratch over N rows: h and dh, and with dropout the dropped input and its adjoint;
// then, over a frozen base in a bf16 step, room for a segment's B and h rounded to bf16
// (lora_rounded_floats, Lora::round_small).
static size_t lora_rounded_floats(const Dims& d, size_t N, Precision precision) {
    if (!d.lora_width || !d.frozen || d.matrix_dtype == DType::f32 || precision != Precision::bf16) return 0;
    return ((N + d.widest_output()) * d.lora_width + 1) / 2;
}
static size_t lora_scratch_floats(const Dims& d, size_t N, bool dropout, Precision precision) {
    if (!d.lora_width) return 0;
    return N * (2 * (size_t)d.lora_width + (dropout ? 2 * (size_t)d.widest_input() : 0)) +
           lora_rounded_floats(d, N, precision);
}

// Every buffer of a training step with the phases it is live in; the planner places them.
// Declared longest-lived first, so the head's logits chunk lands on the buffers dead while the
// head runs (the layers' adjoints and scratch; with checkpointing the shared internals).
// ckpt_layers: layers 0 .. ckpt_layers - 1 keep only their input and are recomputed in the
// pullback (one set of internals they share), the others keep their internals; n_layer is full
// checkpointing. bf16_saved: the kept layers keep q|k|v, the attention output and the MLP input
// in bf16 (a bf16 step only; plan_activations decides).
static ActivationPlan plan_buffers(const Dims& d, int ckpt_layers, Precision precision, bool bf16_saved,
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
    // (Live throughout too: placed here, below the buffers of single phases, it leaves the ones
    // dead while the head runs in one piece for the head's chunk.)
    if (d.frozen && d.matrix_dtype != DType::f32) {
        p.matrix_scratch_floats = matrix_scratch_floats(d, precision, N);
        take(&p.matrix_scratch, "matrix_scratch", p.matrix_scratch_floats, kAllPhases);
    }
    p.layers.resize(d.n_layer);
    const bool checkpointing = ckpt_layers == d.n_layer;  // every layer recomputed
    // Kept in bf16 (bf16.hpp), the layers work on them in fp32 buffers they share.
    std::vector<float*> qkv_bf16(d.n_layer), att_bf16(d.n_layer), fc_bf16(d.n_layer);
    // Set i: the internals of layer i, kept (i >= ckpt_layers), or the one set the recomputed
    // layers share (i == 0 < ckpt_layers), live while a layer's forward or pullback runs; its
    // q|k|v, attention output and MLP input are the bf16 step's fp32 buffers where there are.
    for (int i = 0; i < d.n_layer; i++) {
        const bool kept = i >= ckpt_layers;
        if (!kept && i > 0) continue;
        const unsigned internals = kept ? kAllPhases : kForward | kPullback;
        auto take_saved = [&](float** fp32, float** bf16, const std::string& name, size_t floats) {
            if (bf16_saved && kept)
                take(bf16, name + "_bf16", (floats + 1) / 2, internals);
            else if (!bf16_saved)
                take(fp32, name, floats, internals);
        };
        LayerActs& l = p.layers[i];
        const std::string at = kept ? "layer" + std::to_string(i) + "." : "layers.";
        take(&l.ln1_stats, at + "ln1_stats", stats * N, internals);
        // (live while the head runs too: the last recomputed layer's recompute skips a slot, whose
        // h from the forward it reads)
        if (d.lora_width) take(&l.lora_h, at + "lora_h", (size_t)kLoraSlots * N * d.lora_width, kAllPhases);
        take_saved(&l.qkv, &qkv_bf16[i], at + "qkv", N * d.qkv_dim());
        take(&l.lse, at + "lse", (size_t)B * d.n_head * T, internals);
        take_saved(&l.att, &att_bf16[i], at + "att", N * d.attn_dim());
        if (d.layer->second_norm && !d.layer->parallel) take(&l.res_mid, at + "res_mid", N * D, internals);
        if (d.layer->second_norm) take(&l.ln2_stats, at + "ln2_stats", stats * N, internals);
        take_saved(&l.fc, &fc_bf16[i], at + "fc", N * d.fc_dim());
        if (d.qk_norm) {
            take(&l.qk_raw, at + "qk_raw", N * d.qk_dim(), internals);
            take(&l.qk_stats, at + "qk_stats", (size_t)stats * N * (d.qk_norm == 1 ? d.n_head + d.n_kv_head : 2), internals);
        }
        if (d.post_norm) {  // (without one, the pullback needs no branch output)
            take(&l.attn_branch, at + "attn_branch", N * D, internals);
            take(&l.attn_branch_stats, at + "attn_branch_stats", stats * N, internals);
            take(&l.mlp_branch, at + "mlp_branch", N * D, internals);
            take(&l.mlp_branch_stats, at + "mlp_branch_stats", stats * N, internals);
        }
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
    float *qk_work = nullptr, *branch_out = nullptr, *post_out = nullptr, *norm2_out = nullptr;
    // The two-norm parallel layer's MLP input: its own buffer (h is still read after it is made).
    if (d.layer->parallel && d.layer->second_norm) take(&norm2_out, "norm2_out", N * D, kForward | kPullback);
    if (d.qk_norm) take(&qk_work, "qk_work", N * d.qk_dim(), kForward | kPullback);
    // A branch's output before its add: kept per layer under a post-norm (above), else one
    // buffer the layers share; the post-norm's output likewise.
    if (d.branch_buffer() && !d.post_norm) take(&branch_out, "branch_out", N * D, kForward | kPullback);
    if (d.post_norm) take(&post_out, "post_out", N * D, kForward | kPullback);
    float *qkv_work = nullptr, *att_work = nullptr, *fc_work = nullptr;
    if (bf16_saved) {
        take(&qkv_work, "qkv_work", N * d.qkv_dim(), kForward | kPullback);
        take(&att_work, "att_work", N * d.attn_dim(), kForward | kPullback);
        take(&fc_work, "fc_work", N * d.fc_dim(), kForward | kPullback);
    }
    take(&p.attention_scratch, "attention_scratch",
         Attention{d.n_head, d.n_kv_head, d.head_dim}.scratch_floats(threads, T),
         ckpt_layers ? kForward | kPullback : kForward);
    take(&p.d_res, "d_res", N * D, kPullback);
    take(&p.d_qkv, "d_qkv", N * d.qkv_dim(), kPullback);
    take(&p.d_att, "d_att", N * d.attn_dim(), kPullback);
    take(&p.d_fc, "d_fc", N * d.fc_dim(), kPullback);
    take(&p.d_act, "d_act", N * d.d_ff, kPullback);
    if (ad.on(d.layer->name)) take(&p.d_layer_in, "d_layer_in", N * D, kPullback);
    if (d.qk_norm) take(&p.d_qk, "d_qk", 2 * N * d.qk_dim(), kPullback);
    if (d.branch_buffer() || d.layer->parallel) take(&p.d_branch, "d_branch", N * D, kPullback);
    take(&p.pullback_scratch, "pullback_scratch", pullback_scratch_floats(d, ad, B, T, threads), kPullback);
    if (d.lora_width)
        take(&p.lora_scratch, "lora_scratch", lora_scratch_floats(d, N, d.lora_dropout > 0, precision),
             kForward | kPullback);
    pl.place();
    // The head's chunk fills what is free above the buffers live while it runs.
    p.head_rows = head_chunk_rows(N, d.vocab_size, checkpointing, precision, d.frozen, pl.total() - pl.end_of(kHead),
                                  pl.end_of(kHead));
    take(&p.head_logits, "head_logits", (size_t)p.head_rows * d.vocab_size, kHead);
    if (d.logit_softcap > 0.0f)  // the cap's tanh, for its pullback
        take(&p.head_tanh, "head_tanh", (size_t)p.head_rows * d.vocab_size, kHead);
    if (ad.on("cross_entropy"))
        take(&p.head_scratch, "head_scratch", CrossEntropy{d.vocab_size}.clad_scratch_floats(threads), kHead);
    pl.place();
    pl.check();
    for (const Slot& s : slots) *s.ptr = base ? base + pl[s.index].offset : nullptr;
    // the rounded operands at the end of the adapters' scratch, after what a pass of N rows uses
    p.lora_rounded_values = 2 * lora_rounded_floats(d, N, precision);
    if (p.lora_scratch && p.lora_rounded_values)
        p.lora_rounded = reinterpret_cast<uint16_t*>(p.lora_scratch + lora_scratch_floats(d, N, d.lora_dropout > 0,
                                                                                         precision)) -
                         p.lora_rounded_values;
    for (int i = 0; i < d.n_layer; i++) {
        LayerActs& l = p.layers[i];
        const bool kept = i >= ckpt_layers;
        if (!kept) l = p.layers[0];
        l.x = p.residual ? p.residual + (size_t)i * N * D : nullptr;
        l.out = p.residual ? p.residual + (size_t)(i + 1) * N * D : nullptr;
        l.ln1 = l.ln2 = norm_out;
        if (norm2_out) l.ln2 = norm2_out;
        l.act = act_out;
        l.qk_work = qk_work;
        l.post_out = post_out;
        if (!d.post_norm) l.attn_branch = l.mlp_branch = branch_out;
        l.matrix_scratch = p.matrix_scratch;
        l.lora_scratch = p.lora_scratch;
        if (bf16_saved) {
            l.qkv = qkv_work, l.att = att_work, l.fc = fc_work;
        }
        if (bf16_saved && kept) {
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
// (Recomputed layers keep none.)
ActivationPlan plan_activations(const Dims& d, int ckpt_layers, Precision precision, const AdChoice& ad, int B,
                                int T, float* base, size_t* total_floats) {
    if (ckpt_layers < 0 || ckpt_layers > d.n_layer)
        throw std::invalid_argument("zoo: " + std::to_string(ckpt_layers) + " checkpointed layers of " +
                                    std::to_string(d.n_layer) + ": give 0 to " + std::to_string(d.n_layer));
    bool bf16_saved = false;
    if (precision == Precision::bf16 && ckpt_layers < d.n_layer) {
        size_t kept_fp32 = 0, kept_bf16 = 0;
        plan_buffers(d, ckpt_layers, precision, false, ad, B, T, nullptr, &kept_fp32);
        plan_buffers(d, ckpt_layers, precision, true, ad, B, T, nullptr, &kept_bf16);
        bf16_saved = kept_bf16 < kept_fp32;
    }
    return plan_buffers(d, ckpt_layers, precision, bf16_saved, ad, B, T, base, total_floats);
}

size_t activation_floats(const Dims& d, int ckpt_layers, Precision precision, int B, int T, const AdChoice& ad) {
    size_t total = 0;
    plan_activations(d, ckpt_layers, precision, ad, B, T, nullptr, &total);
    return total;
}

void Executor::set_checkpoint_layers(int layers) {
    if (layers < 0 || layers > d_.n_layer)
        throw std::invalid_argument("zoo: " + std::to_string(layers) + " checkpointed layers of " +
                                    std::to_string(d_.n_layer) + ": give 0 to " + std::to_string(d_.n_layer));
    if (layers != ckpt_layers_) {
        ckpt_layers_ = layers;
        cap_B_ = cap_T_ = 0;  // re-plan at the next step
    }
}

AdChoice ad_choice(const Dims& d, const std::vector<std::string>& clad_blocks) {
    AdChoice ad;
    const auto infos = ad_block_infos();
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
    pb.lora = pick(lora_block.pullback, lora_block.pullback_clad, "lora");
    pb.layer = ad.on(d_.layer->name) ? d_.layer->pullback_clad : nullptr;
    if (pb.layer && d_.frozen)  // its block calls read the fp32 weights and know no adapters
        throw std::invalid_argument(std::string("zoo: layer='") + d_.layer->name +
                                    "' on Clad's chaining runs on a trainable fp32 base only; the hand-chained "
                                    "layer (ad manual for it) trains a frozen base");
    pb.activation_fused = pick(d_.mlp->recompute_and_pullback, d_.mlp->recompute_and_pullback_clad, d_.mlp->name);
    ad_ = ad;
    pb_ = pb;
    cap_B_ = cap_T_ = 0;  // the scratch needs change: re-plan at the next step
}

// A block without a pullback in this build (one written as a forward only, without Clad)
// runs forward but cannot train.
void Executor::check_trainable() const {
    if (d_.frozen && n_params_ == 0)
        throw std::runtime_error("zoo: this model's base is frozen and it has no adapters: nothing to train "
                                 "(give it LoRA adapters, or load the base trainable in fp32)");
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
    if (packed_stale_) repack_base();  // every pass plans first (select_backward, which reads it too, checks)
    if (T > d_.max_seq_len)
        throw std::invalid_argument("zoo: sequence length " + std::to_string(T) + " exceeds max_seq_len " +
                                    std::to_string(d_.max_seq_len));
    ensure_rope(T);  // positions count within a row: below T
    // Attention tiles are laid out for T; per-thread scratch for the threads planned.
    if (B <= cap_B_ && T == cap_T_ && omp_get_max_threads() <= cap_threads_) return;
    acts_.reset(activation_floats(B, T), "activation arena");
    a_ = plan_activations(d_, ckpt_layers_, precision_, ad_, B, T, acts_.data, nullptr);
    cap_B_ = B;
    cap_T_ = T;
    cap_threads_ = omp_get_max_threads();
}

void Executor::norm_forward(const float* x, const float* w, const float* b, float* y, float* stats, int N,
                            int C) const {
    d_.norm->forward({C ? C : d_.d_model, d_.norm_eps, N, x, w, b, stats}, y);
}

void Executor::norm_pullback(const float* x, const float* w, const float* b, float* stats, const float* dy, float* y,
                             float* dx, float* dw, float* db, int N, GradMode mode, int C) const {
    C = C ? C : d_.d_model;
    if (d_.frozen) {  // a frozen norm's dw and db go to a sink nobody reads
        float* sink = frozen_grad_sink_.data();
        dw = sink, db = b ? sink + C : nullptr, mode = GradMode::write;
    }
    pb_.norm({C, d_.norm_eps, N, x, w, b, stats}, dy, y, dx, dw, db, a_.pullback_scratch, mode);
}

// q|k of each qkv row (its first qk_dim floats) to or from [all q rows (N, attn_dim) | all k
// rows (N, n_kv_head x head_dim)], where a norm reads them as contiguous rows.
static void gather_qk(const Dims& d, const float* qkv, float* qk, int N) {
    const size_t q = d.attn_dim(), k = (size_t)d.n_kv_head * d.head_dim;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        std::memcpy(qk + n * q, qkv + (size_t)n * d.qkv_dim(), sizeof(float) * q);
        std::memcpy(qk + N * q + n * k, qkv + (size_t)n * d.qkv_dim() + q, sizeof(float) * k);
    }
}
static void scatter_qk(const Dims& d, const float* qk, float* qkv, int N) {
    const size_t q = d.attn_dim(), k = (size_t)d.n_kv_head * d.head_dim;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        std::memcpy(qkv + (size_t)n * d.qkv_dim(), qk + n * q, sizeof(float) * q);
        std::memcpy(qkv + (size_t)n * d.qkv_dim() + q, qk + N * q + n * k, sizeof(float) * k);
    }
}
// The q|k norm's rows: per head (rows of head_dim) or over the projection (a row per token).
struct QkRows {
    int q_rows, k_rows, q_width, k_width;
};
static QkRows qk_rows(const Dims& d, int N) {
    if (d.qk_norm == 1) return {N * d.n_head, N * d.n_kv_head, d.head_dim, d.head_dim};
    return {N, N, d.attn_dim(), d.n_kv_head * d.head_dim};
}

void Executor::qk_norm_forward(int i, const LayerActs& a, int N) {
    const LayerTensors& w = w_.layers[i];
    const QkRows r = qk_rows(d_, N);
    const int stats = d_.norm->stats_per_row;
    const size_t q_floats = (size_t)N * d_.attn_dim();
    gather_qk(d_, a.qkv, a.qk_raw, N);
    TIMED(forward, norm, norm_forward(a.qk_raw, w.q_norm_w, nullptr, a.qk_work, a.qk_stats, r.q_rows, r.q_width));
    TIMED(forward, norm, norm_forward(a.qk_raw + q_floats, w.k_norm_w, nullptr, a.qk_work + q_floats,
                                      a.qk_stats + (size_t)stats * r.q_rows, r.k_rows, r.k_width));
    scatter_qk(d_, a.qk_work, a.qkv, N);
}

// d_qkv's q|k parts: the normalized q and k's adjoints in, the raw ones' out.
void Executor::qk_norm_pullback(int i, const LayerActs& a, int N, GradMode mode) {
    const LayerTensors& w = w_.layers[i];
    LayerTensors& g = g_.layers[i];
    const QkRows r = qk_rows(d_, N);
    const int stats = d_.norm->stats_per_row;
    const size_t q_floats = (size_t)N * d_.attn_dim(), qk = (size_t)N * d_.qk_dim();
    float *dy = a_.d_qk, *dx = a_.d_qk + qk;
    gather_qk(d_, a_.d_qkv, dy, N);
    std::memset(dx, 0, sizeof(float) * qk);  // the norm pullback adds into dx
    TIMED(pullback, norm, norm_pullback(a.qk_raw, w.q_norm_w, nullptr, a.qk_stats, dy, nullptr, dx, g.q_norm_w,
                                        nullptr, r.q_rows, mode, r.q_width));
    TIMED(pullback, norm, norm_pullback(a.qk_raw + q_floats, w.k_norm_w, nullptr, a.qk_stats + (size_t)stats * r.q_rows,
                                        dy + q_floats, nullptr, dx + q_floats, g.k_norm_w, nullptr, r.k_rows, mode,
                                        r.k_width));
    scatter_qk(d_, dx, a_.d_qkv, N);
}

// out = r + residual_scale x post_norm(y) (no post-norm: y). out may be r (generation).
void Executor::branch_add(const float* y, const float* post_w, const float* post_b, float* stats, float* post_out,
                          const float* r, float* out, int N) {
    if (d_.post_norm) {
        TIMED(forward, norm, norm_forward(y, post_w, post_b, post_out, stats, N));
        y = post_out;
    }
    const float s = d_.residual_scale;
    const size_t n = (size_t)N * d_.d_model;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < n; k++) out[k] = r[k] + s * y[k];
}

// dL/dy of a branch_add, from a_.d_res = dL/d(out), into a_.d_branch (returned). d_norm is
// free here: it takes the scaled adjoint where a post-norm follows.
const float* Executor::branch_pullback(const float* y, const float* post_w, const float* post_b, float* stats,
                                       float* d_post_w, float* d_post_b, int N, GradMode mode) {
    const float s = d_.residual_scale;
    const size_t n = (size_t)N * d_.d_model;
    if (!d_.post_norm) {
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) a_.d_branch[k] = s * a_.d_res[k];
        return a_.d_branch;
    }
    const float* dy = a_.d_res;
    if (s != 1.0f) {
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) a_.d_norm[k] = s * a_.d_res[k];
        dy = a_.d_norm;
    }
    std::memset(a_.d_branch, 0, sizeof(float) * n);
    TIMED(pullback, norm, norm_pullback(y, post_w, post_b, stats, dy, nullptr, a_.d_branch, d_post_w, d_post_b, N, mode));
    return a_.d_branch;
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

// A preference step's selected rows: n >= 1 increasing indices into the N rows, each with a
// target in the vocabulary.
void Executor::check_selection(const int32_t* rows, const int32_t* targets, int n, int N) const {
    if (n < 1 || n > N)
        throw std::invalid_argument("zoo: " + std::to_string(n) + " selected rows of " + std::to_string(N) +
                                    ": select at least one");
    for (int k = 0; k < n; k++) {
        if (rows[k] < 0 || rows[k] >= N || (k && rows[k] <= rows[k - 1]))
            throw std::invalid_argument("zoo: selected rows[" + std::to_string(k) + "] = " + std::to_string(rows[k]) +
                                        ": the rows are increasing indices into the " + std::to_string(N) + " rows");
        if (targets[k] < 0 || targets[k] >= d_.vocab_size)
            throw std::invalid_argument("zoo: target id " + std::to_string(targets[k]) +
                                        " outside the vocabulary [0, " + std::to_string(d_.vocab_size) + ")");
    }
}

// Sets the running step's positions (or hidden spans) for the kernels, and clears them however
// the step ends.
struct PositionsScope {
    const int32_t*& slot;
    PositionsScope(const int32_t*& s, const int32_t* p) : slot(s) { slot = p; }
    ~PositionsScope() { slot = nullptr; }
};
// Sets a flag for the running step (the adapters' dropout: training passes only).
struct FlagScope {
    bool& flag;
    explicit FlagScope(bool& f, bool on = true) : flag(f) { flag = on; }
    ~FlagScope() { flag = false; }
};

LayerCall Executor::layer_call(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0, GradMode mode) {
    const bool cached = pass == LayerPass::cached;
    return LayerCall{&d_, precision_, &pb_, &w_.layers[i], &g_.layers[i], &a, &a_, rope_cos(i), rope_sin(i),
                     positions_, hidden_, cached ? c_attention_scratch_ : a_.attention_scratch,
                     cached ? k_cache_ + cache_offset_[i] : nullptr, cached ? v_cache_ + cache_offset_[i] : nullptr,
                     cached ? cache_cap_[i] : cache_len_, chunk_runs_.data(), chunk_n_runs_, cache_threads_,
                     c_decode_scratch_, B, T, pos0, pass, mode, &profile};
}

void Executor::linear_forward(const Linear& l, bool cached, const float* x, const Matrix& W, const float* b, float* y,
                              int N, const float* residual, float* scratch) {
    if (cached && N <= gemv::max_rows)
        return gemv::product(precision_, N, x, l.in, W, b, residual, l.out, y, l.out, c_decode_scratch_);
    l.forward(x, W, b, y, N, residual, scratch);
}

void Executor::layer_forward(int i, const LayerActs& a, int B, int T, LayerPass pass, int pos0) {
    if (pb_.layer) return d_.layer->forward(layer_call(i, a, B, T, pass, pos0, GradMode::add));
    const int N = B * T, d = d_.d_model;
    const LayerTensors& w = w_.layers[i];
    const LayerMatrices& wm = wm_.layers[i];
    const Attention attn = attention(i);
    const Linear qkv = linear(d, d_.qkv_dim()), attn_out = linear(d_.attn_dim(), d), fc = linear(d, d_.fc_dim()),
                 proj = linear(d_.d_ff, d);
    const bool cached = pass == LayerPass::cached;
    // Each branch reads its input's norm, or the stream itself where the norms follow the branches.
    const float* h1 = d_.pre_norm ? a.ln1 : a.x;
    if (d_.pre_norm) TIMED(forward, norm, norm_forward(a.x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_stats, N));
    adapted_forward(i, lora_qkv, qkv, cached, h1, wm.qkv_w, w.qkv_b, a.qkv, N, nullptr, a);
    if (d_.qk_norm) qk_norm_forward(i, a, N);
    if (layer_rotates(i))  // q and k heads are adjacent: rotate n_head + n_kv_head heads per row
        TIMED(forward, rope, rope().forward(a.qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head, rope_cos(i), rope_sin(i), B,
                                            T, positions_, pos0));
    if (cached) {
        // This call's keys and values join the cache; its queries attend to their sequences' keys.
        TIMED(forward, attention, attn.forward_cached(a.qkv, chunk_runs_.data(), chunk_n_runs_,
                                                      k_cache_ + cache_offset_[i], v_cache_ + cache_offset_[i],
                                                      cache_cap_[i], a.att,
                                                      c_attention_scratch_, cache_threads_));
    } else {
        if (a.qkv_bf16) round_and_save_bf16(a.qkv, a.qkv_bf16, (size_t)N * d_.qkv_dim());
        TIMED(forward, attention, attn.forward(a.qkv, positions_, hidden_, a.lse, a.att, a_.attention_scratch, B, T));
        if (a.att_bf16) round_and_save_bf16(a.att, a.att_bf16, (size_t)N * d_.attn_dim());
    }
    // A parallel layer's MLP reads the layer's input: its norm first (generation then updates the
    // stream in place).
    const float* h2 = d_.layer->second_norm ? a.ln2 : a.ln1;
    if (d_.layer->parallel && d_.layer->second_norm)
        TIMED(forward, norm, norm_forward(a.x, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
    if (d_.branch_buffer()) {
        adapted_forward(i, lora_attn_out, attn_out, cached, a.att, wm.attn_out_w, w.attn_out_b, a.attn_branch, N,
                        nullptr, a);
        branch_add(a.attn_branch, w.post_attn_w, w.post_attn_b, a.attn_branch_stats, a.post_out, a.x, a.res_mid, N);
    } else if (!d_.layer->parallel || pass != LayerPass::recompute) {
        // The residual adds are fused into the projections (res_mid = x + att W^T + b): the
        // profile counts them as linear. A parallel layer adds both branches into its output
        // (no res_mid), which the recompute before a pullback leaves alone.
        float* res_mid = d_.layer->parallel ? a.out : a.res_mid;
        adapted_forward(i, lora_attn_out, attn_out, cached, a.att, wm.attn_out_w, w.attn_out_b, res_mid, N, a.x, a);
    }
    if (!d_.layer->parallel) {
        h2 = d_.pre_norm ? a.ln2 : a.res_mid;
        if (d_.pre_norm) TIMED(forward, norm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
    }
    adapted_forward(i, lora_fc, fc, cached, h2, wm.fc_w, w.fc_b, a.fc, N, nullptr, a);
    if (a.fc_bf16) round_and_save_bf16(a.fc, a.fc_bf16, (size_t)N * d_.fc_dim());
    TIMED(forward, activation, d_.mlp->forward(d_.d_ff, a.fc, a.act, N));
    // The MLP output only feeds the next layer's input, which the recompute before a pullback
    // keeps; a post-norm's pullback reads the MLP output and its statistics, though.
    if (pass == LayerPass::recompute && !d_.post_norm) return;
    if (d_.branch_buffer()) {
        adapted_forward(i, lora_proj, proj, cached, a.act, wm.proj_w, w.proj_b, a.mlp_branch, N, nullptr, a);
        if (pass == LayerPass::recompute) {
            TIMED(forward, norm, norm_forward(a.mlp_branch, w.post_mlp_w, w.post_mlp_b, a.post_out, a.mlp_branch_stats, N));
            return;
        }
        branch_add(a.mlp_branch, w.post_mlp_w, w.post_mlp_b, a.mlp_branch_stats, a.post_out, a.res_mid, a.out, N);
        return;
    }
    adapted_forward(i, lora_proj, proj, cached, a.act, wm.proj_w, w.proj_b, a.out, N,
                    d_.layer->parallel ? a.out : a.res_mid, a);
}

// The dropout masks of one pass: a training step's passes each draw their own, the recompute
// of a checkpointed layer and the pullback the same ones as the forward.
uint64_t Executor::dropout_seed(int i, LoraSlot slot) const {
    uint64_t z = d_.lora_seed;
    for (uint64_t v : {(uint64_t)step_count, (uint64_t)passes_since_step_, (uint64_t)i, (uint64_t)slot})
        z = (z ^ v) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    return z;
}

static Lora slot_lora(const Dims& d, LoraSlot slot, const SlotAdapters& s, Precision p) {
    return Lora{slot_in(d, slot), slot_out(d, slot), s.rank, s.n_seg, s.seg.data(), d.lora_scale, p};
}

// A linear layer's forward with its adapters (y = residual + x W^T + b + the adapters of x).
// Over a narrow frozen base in a bf16 step two things save passes over memory, with the same
// bits:
// - x is rounded to bf16 once for the base's product and the adapters' first (without dropout,
//   where both read x itself);
// - a layer without a bias or residual add takes its adapters' output first, its product adding
//   onto it: the adapters then write y once, where adding to the product's output read it too
//   (their pass is bound by memory; the product reads y while it computes). oneDNN's kernel sums
//   all of K before it adds y, so the two fp32 terms are added once either way (OpenBLAS's fp32
//   kernels add into C block by block of K: there the order would change the bits).
void Executor::adapted_forward(int i, LoraSlot slot, const Linear& l, bool cached, const float* x, const Matrix& W,
                               const float* b, float* y, int N, const float* residual, const LayerActs& a) {
    const SlotAdapters& s = adapters_[i][slot];
    const bool adapted = s.n_seg && adapters_on_;
    const bool narrow = !cached && precision_ == Precision::bf16 && d_.frozen && W.dtype != DType::f32 &&
                        a.matrix_scratch;
    if (!adapted || !narrow) {
        TIMED(forward, linear, linear_forward(l, cached, x, W, b, y, N, residual, a.matrix_scratch));
        return adapter_forward(i, slot, x, y, N, a);
    }
    const Lora lo = slot_lora(d_, slot, s, precision_);
    const bool first = !b && !residual && lo.covers_output();
    const bool shared = !(dropout_on_ && d_.lora_dropout > 0) && a_.lora_rounded &&
                        (size_t)lo.nr() * lo.in <= a_.lora_rounded_values;
    if (!shared) {
        if (first) {
            adapter_forward(i, slot, x, y, N, a, true);
            TIMED(forward, linear, linear_forward(l, cached, x, W, nullptr, y, N, y, a.matrix_scratch));
        } else {
            TIMED(forward, linear, linear_forward(l, cached, x, W, b, y, N, residual, a.matrix_scratch));
            adapter_forward(i, slot, x, y, N, a);
        }
        return;
    }
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(a.matrix_scratch);
    TIMED(forward, linear, gemm::round_to_bf16(x, l.in, N, l.in, reinterpret_cast<uint16_t*>(a.matrix_scratch)));
    if (first) {
        TIMED(forward, lora, lo.forward_rounded(xb, s.A, s.B, y, N, slot_h(a, slot, N), a_.lora_rounded, true));
        TIMED(forward, linear, l.forward_rounded(W, nullptr, y, N, y, a.matrix_scratch));
    } else {
        TIMED(forward, linear, l.forward_rounded(W, b, y, N, residual, a.matrix_scratch));
        TIMED(forward, lora, lo.forward_rounded(xb, s.A, s.B, y, N, slot_h(a, slot, N), a_.lora_rounded, false));
    }
    note_h(i, slot, a);
}

// y += the slot's adapters of x (x dropped first in a training pass); write: y = them.
void Executor::adapter_forward(int i, LoraSlot slot, const float* x, float* y, int N, const LayerActs& a, bool write) {
    const SlotAdapters& s = adapters_[i][slot];
    if (!s.n_seg || !adapters_on_) return;
    const Lora l = slot_lora(d_, slot, s, precision_);
    if (dropout_on_ && d_.lora_dropout > 0) {
        float* xd = a.lora_scratch + 2 * (size_t)N * d_.lora_width;
        lora_dropout(dropout_seed(i, slot), d_.lora_dropout, x, xd, (size_t)N * l.in);
        x = xd;
    }
    if (write)
        TIMED(forward, lora, l.forward_write(x, s.A, s.B, y, N, slot_h(a, slot, N)));
    else
        TIMED(forward, lora, l.forward(x, s.A, s.B, y, N, slot_h(a, slot, N)));
    note_h(i, slot, a);
}

// Where a slot's forward puts h: kept for the pullback (LayerActs::lora_h), or the scratch.
float* Executor::slot_h(const LayerActs& a, LoraSlot slot, int N) const {
    return a.lora_h ? a.lora_h + (size_t)slot * N * d_.lora_width : a.lora_scratch;
}
void Executor::note_h(int i, LoraSlot slot, const LayerActs& a) {
    if (a.lora_h && (size_t)i < h_from_.size()) h_from_[internals_set(i)][slot] = h_key(i);
}

// dx += the slot's adapters' part of the input's adjoint; dA, dB per mode.
void Executor::adapter_pullback(int i, LoraSlot slot, const float* x, const float* dy, float* dx, int N, GradMode mode,
                                const LayerActs& a) {
    const SlotAdapters& s = adapters_[i][slot];
    if (!s.n_seg) return;
    Lora l = pullback_lora(slot, s, a);
    // h from this layer's forward (or recompute) in this pass, which ran with the adapters on
    if (a.lora_h && adapters_on_ && (size_t)i < h_from_.size() && h_from_[internals_set(i)][slot] == h_key(i))
        l.h_saved = slot_h(a, slot, N);
    if (dropout_on_ && d_.lora_dropout > 0) {
        float* xd = a.lora_scratch + 2 * (size_t)N * d_.lora_width;
        float* dxd = xd + (size_t)N * d_.widest_input();
        const uint64_t seed = dropout_seed(i, slot);
        lora_dropout(seed, d_.lora_dropout, x, xd, (size_t)N * l.in);
        TIMED(pullback, lora, pb_.lora(l, xd, s.A, s.B, dy, dxd, s.dA, s.dB, N, false, mode, a.lora_scratch));
        lora_dropout_pullback(seed, d_.lora_dropout, dxd, dx, (size_t)N * l.in);
    } else {
        TIMED(pullback, lora, pb_.lora(l, x, s.A, s.B, dy, dx, s.dA, s.dB, N, true, mode, a.lora_scratch));
    }
}

// The adapters' pullback runs after its linear layer's (linear_pullback), whose products are
// done with the frozen base's matrix scratch then: the adapters round dy into it.
Lora Executor::pullback_lora(LoraSlot slot, const SlotAdapters& s, const LayerActs& a) const {
    Lora l = slot_lora(d_, slot, s, precision_);
    if (a.matrix_scratch && a_.lora_rounded) {
        l.round_buf = reinterpret_cast<uint16_t*>(a.matrix_scratch);
        l.round_values = 2 * a_.matrix_scratch_floats;
        l.round_small = a_.lora_rounded;
        l.round_small_values = a_.lora_rounded_values;
    }
    return l;
}

void Executor::linear_pullback(int i, LoraSlot slot, const Linear& l, const float* x, const float* W, const Matrix& Wm,
                               const float* b, const float* dy, float* dx, float* dW, float* db, int N, GradMode mode,
                               const LayerActs& a) {
    if (d_.frozen)
        TIMED(pullback, linear, l.pullback_input(Wm, dy, dx, N, false, a.matrix_scratch));
    else
        TIMED(pullback, linear, pb_.linear(l, x, W, b, dy, dx, dW, db, N, mode, a_.pullback_scratch));
    adapter_pullback(i, slot, x, dy, dx, N, mode, a);
}

// a_.d_res holds dL/d(layer output) on entry and dL/d(layer input) on exit: the residual adds
// pass it through unchanged, so the norm pullbacks add their parts into it.
void Executor::layer_pullback(int i, int B, int T, GradMode mode) {
    if (pb_.layer) return pb_.layer(layer_call(i, a_.layers[i], B, T, LayerPass::replay, 0, mode));
    if (d_.layer->parallel) return parallel_pullback(i, B, T, mode);
    const int N = B * T, d = d_.d_model;
    const LayerTensors& w = w_.layers[i];
    const LayerMatrices& wm = wm_.layers[i];
    LayerTensors& g = g_.layers[i];
    const LayerActs& a = a_.layers[i];
    const Attention attn = attention(i);
    const Linear qkv = linear(d, d_.qkv_dim()), attn_out = linear(d_.attn_dim(), d), fc = linear(d, d_.fc_dim()),
                 proj = linear(d_.d_ff, d);
    float* scratch = a_.pullback_scratch;
    expand_saved_bf16(d_, a, N);
    // The norm outputs and the activation output live in buffers every layer shares, and the
    // weight gradient of the linear layer after each reads its own. With a trainable base that
    // layer's pullback runs in halves: dx first, then the pullback of the block before it,
    // which also recomputes the block's output in the same pass (the hand-written activation's
    // fused kernel; a Clad gradient's replay), then dW from that output. A frozen base's
    // adapters read the input for their own dx, so there each output is recomputed first.
    const auto input_half = [&](const Linear& l, const float* W, const float* b, const float* dy, float* dx) {
        TIMED(pullback, linear, pb_.linear(l, nullptr, W, b, dy, dx, nullptr, nullptr, N, mode, scratch));
    };
    const auto weight_half = [&](const Linear& l, const float* x, const float* W, const float* b, const float* dy,
                                 float* dW, float* db) {
        TIMED(pullback, linear, pb_.linear(l, x, W, b, dy, nullptr, dW, db, N, mode, scratch));
    };
    // A branch without a norm on its input adds its input's adjoint straight into the stream's.
    const auto add_to_stream = [&](const float* dx) {
        const size_t n = (size_t)N * d;
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) a_.d_res[k] += dx[k];
    };
    // The MLP's output adjoint: the stream's, or through the branch's post-norm and scale.
    const float* d_mlp = d_.branch_buffer() ? branch_pullback(a.mlp_branch, w.post_mlp_w, w.post_mlp_b,
                                                              a.mlp_branch_stats, g.post_mlp_w, g.post_mlp_b, N, mode)
                                            : a_.d_res;
    if (!d_.frozen && pb_.activation_fused) {  // (an activation may have no fused pullback)
        input_half(proj, w.proj_w, w.proj_b, d_mlp, a_.d_act);
        TIMED(pullback, activation, pb_.activation_fused(d_.d_ff, a.fc, a_.d_act, a.act, a_.d_fc, N));
        weight_half(proj, a.act, w.proj_w, w.proj_b, d_mlp, g.proj_w, g.proj_b);
    } else {
        TIMED(pullback, activation, d_.mlp->forward(d_.d_ff, a.fc, a.act, N));
        linear_pullback(i, lora_proj, proj, a.act, w.proj_w, wm.proj_w, w.proj_b, d_mlp, a_.d_act, g.proj_w,
                        g.proj_b, N, mode, a);
        TIMED(pullback, activation, pb_.activation(d_.d_ff, a.fc, a_.d_act, a_.d_fc, N));
    }
    const float* h2 = d_.pre_norm ? a.ln2 : a.res_mid;
    if (!d_.pre_norm) {
        linear_pullback(i, lora_fc, fc, h2, w.fc_w, wm.fc_w, w.fc_b, a_.d_fc, a_.d_norm, g.fc_w, g.fc_b, N, mode, a);
        add_to_stream(a_.d_norm);
    } else if (!d_.frozen) {
        input_half(fc, w.fc_w, w.fc_b, a_.d_fc, a_.d_norm);
        TIMED(pullback, norm, norm_pullback(a.res_mid, w.ln2_w, w.ln2_b, a.ln2_stats, a_.d_norm, a.ln2, a_.d_res,
                                            g.ln2_w, g.ln2_b, N, mode));
        weight_half(fc, a.ln2, w.fc_w, w.fc_b, a_.d_fc, g.fc_w, g.fc_b);
    } else {
        TIMED(pullback, norm, norm_forward(a.res_mid, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
        linear_pullback(i, lora_fc, fc, a.ln2, w.fc_w, wm.fc_w, w.fc_b, a_.d_fc, a_.d_norm, g.fc_w, g.fc_b, N, mode,
                        a);
        TIMED(pullback, norm, norm_pullback(a.res_mid, w.ln2_w, w.ln2_b, a.ln2_stats, a_.d_norm, nullptr, a_.d_res,
                                            g.ln2_w, g.ln2_b, N, mode));
    }
    const float* d_attn = d_.branch_buffer() ? branch_pullback(a.attn_branch, w.post_attn_w, w.post_attn_b,
                                                               a.attn_branch_stats, g.post_attn_w, g.post_attn_b, N,
                                                               mode)
                                             : a_.d_res;
    linear_pullback(i, lora_attn_out, attn_out, a.att, w.attn_out_w, wm.attn_out_w, w.attn_out_b, d_attn, a_.d_att,
                    g.attn_out_w, g.attn_out_b, N, mode, a);
    TIMED(pullback, attention,
          pb_.attention(attn, a.qkv, positions_, hidden_, a.lse, a_.d_att, a_.d_qkv, scratch, B, T));
    if (layer_rotates(i))
        TIMED(pullback, rope, pb_.rope(rope(), a_.d_qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head, rope_cos(i),
                                       rope_sin(i), B, T, positions_));
    if (d_.qk_norm) qk_norm_pullback(i, a, N, mode);
    if (!d_.pre_norm) {
        linear_pullback(i, lora_qkv, qkv, a.x, w.qkv_w, wm.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm, g.qkv_w, g.qkv_b, N,
                        mode, a);
        add_to_stream(a_.d_norm);
    } else if (!d_.frozen) {
        input_half(qkv, w.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm);
        TIMED(pullback, norm, norm_pullback(a.x, w.ln1_w, w.ln1_b, a.ln1_stats, a_.d_norm, a.ln1, a_.d_res, g.ln1_w,
                                            g.ln1_b, N, mode));
        weight_half(qkv, a.ln1, w.qkv_w, w.qkv_b, a_.d_qkv, g.qkv_w, g.qkv_b);
    } else {
        TIMED(pullback, norm, norm_forward(a.x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_stats, N));
        linear_pullback(i, lora_qkv, qkv, a.ln1, w.qkv_w, wm.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm, g.qkv_w, g.qkv_b,
                        N, mode, a);
        TIMED(pullback, norm, norm_pullback(a.x, w.ln1_w, w.ln1_b, a.ln1_stats, a_.d_norm, nullptr, a_.d_res,
                                            g.ln1_w, g.ln1_b, N, mode));
    }
}

// The parallel layers' pullback: out = res_mid + mlp(h2), res_mid = x + attn(h1), h1 = norm1(x),
// h2 = norm2(x) (or h1 with one norm). a_.d_res holds dL/d(out) = dL/d(res_mid) on entry; the
// MLP's part of dL/dx waits in d_branch until the attention branch has read d_res.
void Executor::parallel_pullback(int i, int B, int T, GradMode mode) {
    const int N = B * T, d = d_.d_model;
    const LayerTensors& w = w_.layers[i];
    const LayerMatrices& wm = wm_.layers[i];
    LayerTensors& g = g_.layers[i];
    const LayerActs& a = a_.layers[i];
    const Attention attn = attention(i);
    const Linear qkv = linear(d, d_.qkv_dim()), attn_out = linear(d_.attn_dim(), d), fc = linear(d, d_.fc_dim()),
                 proj = linear(d_.d_ff, d);
    const bool two = d_.layer->second_norm;
    expand_saved_bf16(d_, a, N);
    // The norm outputs, in buffers every layer shares: recomputed.
    TIMED(pullback, norm, norm_forward(a.x, w.ln1_w, w.ln1_b, a.ln1, a.ln1_stats, N));
    if (two) TIMED(pullback, norm, norm_forward(a.x, w.ln2_w, w.ln2_b, a.ln2, a.ln2_stats, N));
    const float* h2 = two ? a.ln2 : a.ln1;
    TIMED(pullback, activation, d_.mlp->forward(d_.d_ff, a.fc, a.act, N));
    linear_pullback(i, lora_proj, proj, a.act, w.proj_w, wm.proj_w, w.proj_b, a_.d_res, a_.d_act, g.proj_w, g.proj_b,
                    N, mode, a);
    TIMED(pullback, activation, pb_.activation(d_.d_ff, a.fc, a_.d_act, a_.d_fc, N));
    linear_pullback(i, lora_fc, fc, h2, w.fc_w, wm.fc_w, w.fc_b, a_.d_fc, a_.d_norm, g.fc_w, g.fc_b, N, mode, a);
    const size_t n = (size_t)N * d;
    if (two) {
        std::memset(a_.d_branch, 0, sizeof(float) * n);
        TIMED(pullback, norm, norm_pullback(a.x, w.ln2_w, w.ln2_b, a.ln2_stats, a_.d_norm, nullptr, a_.d_branch,
                                            g.ln2_w, g.ln2_b, N, mode));
    } else {
        std::memcpy(a_.d_branch, a_.d_norm, sizeof(float) * n);  // h1's adjoint from the MLP
    }
    linear_pullback(i, lora_attn_out, attn_out, a.att, w.attn_out_w, wm.attn_out_w, w.attn_out_b, a_.d_res, a_.d_att,
                    g.attn_out_w, g.attn_out_b, N, mode, a);
    TIMED(pullback, attention,
          pb_.attention(attn, a.qkv, positions_, hidden_, a.lse, a_.d_att, a_.d_qkv, a_.pullback_scratch, B, T));
    if (layer_rotates(i))
        TIMED(pullback, rope, pb_.rope(rope(), a_.d_qkv, d_.qkv_dim(), d_.n_head + d_.n_kv_head, rope_cos(i),
                                       rope_sin(i), B, T, positions_));
    linear_pullback(i, lora_qkv, qkv, a.ln1, w.qkv_w, wm.qkv_w, w.qkv_b, a_.d_qkv, a_.d_norm, g.qkv_w, g.qkv_b, N,
                    mode, a);
    float* d_res = a_.d_res;
    const float* d_branch = a_.d_branch;
    if (!two) {
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) a_.d_norm[k] += d_branch[k];
    }
    TIMED(pullback, norm, norm_pullback(a.x, w.ln1_w, w.ln1_b, a.ln1_stats, a_.d_norm, nullptr, d_res, g.ln1_w,
                                        g.ln1_b, N, mode));
    if (two) {
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) d_res[k] += d_branch[k];
    }
}

// x *= s over n floats (the embedding and logit scales; a no-op at 1).
static void scale_floats(float* x, size_t n, float s) {
    if (s == 1.0f) return;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < n; k++) x[k] *= s;
}

// The LM head's products into logits: times logit_scale, then soft-capped (cap tanh(z / cap)),
// keeping the tanh in t for the pullback where t is not null.
void Executor::finish_logits(float* z, size_t n, float* t) const {
    scale_floats(z, n, d_.logit_scale);
    const float cap = d_.logit_softcap;
    if (cap <= 0.0f) return;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < n; k++) {
        const float th = fast_tanh(z[k] / cap);
        if (t) t[k] = th;
        z[k] = cap * th;
    }
}

// The adjoint of the products from that of the logits, in place.
void Executor::logits_pullback(float* dz, const float* t, size_t n) const {
    if (d_.logit_softcap > 0.0f) {
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < n; k++) dz[k] *= 1.0f - t[k] * t[k];
    }
    scale_floats(dz, n, d_.logit_scale);
}

// Embedding, every layer, final norm: leaves a_.lnf ready for the head.
void Executor::trunk_forward(const int32_t* tokens, int B, int T) {
    const int N = B * T, d = d_.d_model;
    trunk_passes_++;
    h_from_.assign(d_.n_layer, {});
    TIMED(forward, embedding, Embedding{d}.forward(tokens, positions_, wm_.wte, w_.wpe, a_.residual, B, T));
    scale_floats(a_.residual, (size_t)N * d, d_.embedding_scale);
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
        TIMED(forward, lm_head, lm.forward(x, head_matrix(), nullptr, a_.head_logits, rows, nullptr, a_.matrix_scratch));
        // (The scale and soft cap count as the cross-entropy's, the head's other elementwise pass.)
        TIMED(forward, cross_entropy, finish_logits(a_.head_logits, (size_t)rows * V, pullback ? a_.head_tanh : nullptr));
        if (!pullback) {
            TIMED(forward, cross_entropy,
                  chunk_mean = ce.forward(a_.head_logits, targets + r0, a_.row_loss + r0, rows, &counted));
            total += chunk_mean * counted;
            continue;
        }
        // The hand-written pullback is fused with the forward: the profile counts it as forward.
        TIMED(forward, cross_entropy,
              chunk_mean = pb_.cross_entropy(ce, a_.head_logits, targets + r0, a_.row_loss + r0, rows, n_valid,
                                             grad_scale, &counted, nullptr, a_.head_scratch));
        total += chunk_mean * counted;
        TIMED(pullback, cross_entropy, logits_pullback(a_.head_logits, a_.head_tanh, (size_t)rows * V));
        if (d_.frozen)
            TIMED(pullback, lm_head, lm.pullback_input(head_matrix(), a_.head_logits, a_.d_norm + (size_t)r0 * d, rows,
                                                       false, a_.matrix_scratch));
        else
            TIMED(pullback, lm_head, pb_.linear(lm, x, head_weight(), nullptr, a_.head_logits, a_.d_norm + (size_t)r0 * d,
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

double Executor::forward(const int32_t* tokens, const int32_t* targets, const int32_t* positions,
                         const int32_t* hidden, int B, int T) {
    plan(B, T);
    const int N = B * T;
    check_ids(tokens, targets, N);
    check_visible_keys(positions, hidden, B, T);
    sel_.pending = false;  // this pass overwrites what a select_backward would read
    const PositionsScope scope(positions_, positions), hidden_scope(hidden_, hidden);
    poison_dead_buffers(kForward);
    trunk_forward(tokens, B, T);
    poison_dead_buffers(kHead);
    if (targets) return head(targets, N, false, 0.0f, GradMode::add);
    // Full logits only for callers that ask for them (inference): their own arena.
    const size_t need = (size_t)N * d_.vocab_size;
    if (logits_arena_.size < need) logits_arena_.reset(need, "logits");
    TIMED(forward, lm_head,
          linear(d_.d_model, d_.vocab_size).forward(a_.lnf, head_matrix(), nullptr, logits_arena_.data, N, nullptr,
                                                    a_.matrix_scratch));
    finish_logits(logits_arena_.data, need, nullptr);
    return NAN;
}

double Executor::forward_backward(const int32_t* tokens, const int32_t* targets, const int32_t* positions,
                                  const int32_t* hidden, int B, int T, float grad_scale) {
    check_trainable();
    grads();  // mapped at the first training pass
    plan(B, T);
    const int N = B * T;
    check_ids(tokens, targets, N);
    check_visible_keys(positions, hidden, B, T);
    sel_.pending = false;
    const PositionsScope scope(positions_, positions), hidden_scope(hidden_, hidden);
    const FlagScope dropout(dropout_on_);
    const GradMode mode = grads_.pass_mode();
    const bool first = grads_.pass_is_first();
    grads_.begin_pass();
    poison_dead_buffers(kForward);
    trunk_forward(tokens, B, T);
    poison_dead_buffers(kHead);
    double loss = head(targets, N, true, grad_scale, mode);
    trunk_pullback(tokens, B, T, mode, first);
    return loss;
}

// Moves the selected rows of lnf to its first n rows (in order: row k comes from rows[k] >= k),
// where the head reads them.
static void gather_rows(float* x, const int32_t* rows, int n, int d) {
    for (int k = 0; k < n; k++)
        if (rows[k] != k) std::memcpy(x + (size_t)k * d, x + (size_t)rows[k] * d, sizeof(float) * d);
}
// The reverse: the first n rows of dx back to rows[k] (last first, so none is overwritten before
// it moves), and zeros on every row not selected (N rows in all).
static void scatter_rows(float* dx, const int32_t* rows, int n, int N, int d) {
    for (int k = n - 1; k >= 0; k--)
        if (rows[k] != k) std::memcpy(dx + (size_t)rows[k] * d, dx + (size_t)k * d, sizeof(float) * d);
    for (int r = 0, k = 0; r < N; r++) {
        if (k < n && rows[k] == r) {
            k++;
            continue;
        }
        std::memset(dx + (size_t)r * d, 0, sizeof(float) * d);
    }
}

// The LM head over the selected rows (lnf's first n), chunk by chunk: each row's cross-entropy
// into row_loss, and with adjoint the head's input adjoint into d_norm's first n rows. Every
// pass takes the loss from the same fused cross-entropy, so a pass with the adapters off and
// one with them on give bit-equal losses where the models agree (the rewards at step 0).
// row_weight null: the adjoint of the unweighted row losses (what a frozen head's training
// forward keeps: the weights come later, and scale the rows, select_backward); else
// dL/d(row_loss[k]) = grad_scale * row_weight[k], and a trainable head's gradient too.
void Executor::head_selected(const int32_t* targets, int n, float* row_loss, bool adjoint, const float* row_weight,
                             float grad_scale, GradMode mode) {
    const int d = d_.d_model, V = d_.vocab_size;
    const CrossEntropy ce{V};
    const Linear lm = linear(d, V);
    for (int r0 = 0; r0 < n; r0 += a_.head_rows) {
        const int rows = std::min(a_.head_rows, n - r0);
        const float* x = a_.lnf + (size_t)r0 * d;
        int counted = 0;
        TIMED(forward, lm_head, lm.forward(x, head_matrix(), nullptr, a_.head_logits, rows, nullptr, a_.matrix_scratch));
        TIMED(forward, cross_entropy, finish_logits(a_.head_logits, (size_t)rows * V, adjoint ? a_.head_tanh : nullptr));
        // (n_valid 1, grad_scale 1: each row's seed is 1 where no weights are given)
        TIMED(forward, cross_entropy,
              pb_.cross_entropy(ce, a_.head_logits, targets + r0, row_loss + r0, rows, 1,
                                row_weight ? grad_scale : 1.0f, &counted, row_weight ? row_weight + r0 : nullptr,
                                a_.head_scratch));
        if (!adjoint) continue;
        TIMED(pullback, cross_entropy, logits_pullback(a_.head_logits, a_.head_tanh, (size_t)rows * V));
        float* dx = a_.d_norm + (size_t)r0 * d;
        if (d_.frozen)
            TIMED(pullback, lm_head, lm.pullback_input(head_matrix(), a_.head_logits, dx, rows, false, a_.matrix_scratch));
        else
            TIMED(pullback, lm_head, pb_.linear(lm, x, head_weight(), nullptr, a_.head_logits, dx, head_grad(), nullptr,
                                                rows, r0 == 0 ? mode : GradMode::add, nullptr));
    }
}

void Executor::select_forward(const int32_t* tokens, const int32_t* positions, const int32_t* hidden,
                              const int32_t* rows, const int32_t* targets, int n, int B, int T, bool train,
                              float* row_loss) {
    if (train) {
        check_trainable();
        if (!adapters_on_) throw std::logic_error("zoo: the adapters are off; a training pass needs them on");
        grads();
    }
    plan(B, T);
    const int N = B * T;
    check_ids(tokens, nullptr, N);
    check_visible_keys(positions, hidden, B, T);
    check_selection(rows, targets, n, N);
    sel_.pending = false;
    // Copies (capacity kept from the largest batch: no allocation once a plan is made).
    sel_.tokens.assign(tokens, tokens + N);
    sel_.positions.assign(positions, positions ? positions + N : positions);
    sel_.hidden.assign(hidden, hidden ? hidden + 2 * (size_t)N : hidden);
    sel_.rows.assign(rows, rows + n);
    sel_.targets.assign(targets, targets + n);
    sel_.B = B, sel_.T = T, sel_.n = n;
    const PositionsScope scope(positions_, positions ? sel_.positions.data() : nullptr),
        hidden_scope(hidden_, hidden ? sel_.hidden.data() : nullptr);
    const FlagScope dropout(dropout_on_, train);
    poison_dead_buffers(kForward);
    trunk_forward(sel_.tokens.data(), B, T);
    poison_dead_buffers(kHead);
    gather_rows(a_.lnf, sel_.rows.data(), n, d_.d_model);
    // A frozen head's input adjoint is the row weights times that of the unweighted row losses:
    // taken now, from the logits this pass has, the pullback needs no second pass of the head.
    sel_.head_adjoint = train && d_.frozen;
    head_selected(sel_.targets.data(), n, row_loss, sel_.head_adjoint, nullptr, 0.0f, GradMode::add);
    sel_.pending = train;
}

void Executor::select_backward(const float* row_weight, float grad_scale) {
    if (!sel_.pending)
        throw std::logic_error("zoo: select_backward needs a training select_forward just before it (no other pass "
                               "between)");
    sel_.pending = false;
    if (packed_stale_) repack_base();  // the base was stored into since the forward
    const int B = sel_.B, T = sel_.T, N = B * T, n = sel_.n, d = d_.d_model;
    const PositionsScope scope(positions_, sel_.positions.empty() ? nullptr : sel_.positions.data()),
        hidden_scope(hidden_, sel_.hidden.empty() ? nullptr : sel_.hidden.data());
    const FlagScope dropout(dropout_on_);
    const GradMode mode = grads_.pass_mode();
    const bool first = grads_.pass_is_first();
    grads_.begin_pass();
    if (sel_.head_adjoint) {
#pragma omp parallel for schedule(static)
        for (int k = 0; k < n; k++) {
            const float w = grad_scale * row_weight[k];
            float* dx = a_.d_norm + (size_t)k * d;
            for (int c = 0; c < d; c++) dx[c] *= w;
        }
    } else {
        poison_dead_buffers(kHead);
        head_selected(sel_.targets.data(), n, a_.row_loss, true, row_weight, grad_scale, mode);
    }
    scatter_rows(a_.d_norm, sel_.rows.data(), n, N, d);
    trunk_pullback(sel_.tokens.data(), B, T, mode, first);
}

void Executor::trunk_pullback(const int32_t* tokens, int B, int T, GradMode mode, bool first) {
    const int N = B * T, d = d_.d_model;
    poison_dead_buffers(kPullback);
    std::memset(a_.d_res, 0, sizeof(float) * N * d);
    TIMED(pullback, norm, norm_pullback(a_.layers.back().out, w_.lnf_w, w_.lnf_b, a_.lnf_stats, a_.d_norm, nullptr,
                                        a_.d_res, g_.lnf_w, g_.lnf_b, N, mode));
    // On a first pass each layer's squared norm is taken as soon as its pullback has written
    // the gradients, while they are still in cache: adamw_step's clipping then needs no pass
    // of its own over every gradient.
    double sumsq = 0.0;
    for (int i = d_.n_layer - 1; i >= 0; i--) {
        if (i < ckpt_layers_) layer_forward(i, a_.layers[i], B, T, LayerPass::recompute);
        layer_pullback(i, B, T, mode);
        if (first) TIMED(forward, adamw, sumsq += grad_sum_squares(layer_grad_ranges_[i]));
    }
    // A tied dwte holds the LM head's gradient already: the embedding adds to it. (A frozen
    // base's embedding has no gradient.)
    const Embedding emb{d, d_.vocab_size, d_.max_seq_len};
    if (!d_.frozen) {
        scale_floats(a_.d_res, (size_t)N * d, d_.embedding_scale);
        TIMED(pullback, embedding, pb_.embedding(emb, tokens, positions_, w_.wte, w_.wpe, a_.d_res, g_.wte, g_.wpe, B,
                                                 T, d_.tied_embeddings ? GradMode::add : mode, mode));
    }
    passes_since_step_++;
    if (first) {
        TIMED(forward, adamw, sumsq += grad_sum_squares(other_grad_ranges_));
        grads_.end_first_pass(sumsq);
    }
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
    double t0 = profile.on ? Profile::now() : 0.0;
    if (norm < 0) norm = grad_norm();
    float scale = 1.0f;
    if (max_norm > 0 && norm > max_norm) scale = (float)(max_norm / (norm + 1e-6));
    step_count++;
    passes_since_step_ = 0;
    sel_.pending = false;  // the dropout masks of a select_forward before this step are gone
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
    if (profile.on) profile.forward[k_adamw] += Profile::now() - t0;
    return norm;
}

// The generation arena for up to (B, max_len): the KV cache, and every buffer of a call's chunk
// of rows (at most cache_chunk_rows: a long prompt goes through in pieces), one after the
// other. One function, so that reset_cache and cache_floats (the memory check) agree.
struct CacheLayout {
    size_t k, v, x, norm, stats, qkv, att, fc, act, attention, last, logits, matrix, decode, lora, floats;
    size_t qk_raw, qk_stats, qk_work, branch, branch_stats, post_out;  // the variants' (Dims)
    int rows;
};
// Layer i's KV cache holds cache_cap(d, i, ...) positions per slot: all of them, or for a
// layer with a window a ring of the keys a call's rows can see (window - 1 before the first of
// at most `rows` rows): its memory bounded by the window, not the length.
static int cache_cap(const Dims& d, int i, int max_len, int rows) {
    const int w = d.layer_window.empty() ? 0 : d.layer_window[i];
    return w ? (int)std::min<int64_t>(max_len, (int64_t)w - 1 + rows) : max_len;
}

static CacheLayout cache_layout(const Dims& d, int B, int max_len, int threads) {
    limits::check_batch(B, max_len, "reset_cache");
    if (max_len > d.max_seq_len)
        throw std::invalid_argument("zoo: generation length " + std::to_string(max_len) + " exceeds max_seq_len " +
                                    std::to_string(d.max_seq_len));
    const int rows = std::min(B * max_len, cache_chunk_rows);  // check_batch keeps B * max_len an int
    size_t kv = 0;
    for (int i = 0; i < d.n_layer; i++) kv += (size_t)B * d.n_kv_head * cache_cap(d, i, max_len, rows) * d.head_dim;
    const size_t D = d.d_model;
    const size_t N = rows;
    ArenaPlanner pl;
    CacheLayout c;
    c.rows = rows;
    c.k = pl.take(kv), c.v = pl.take(kv), c.x = pl.take(N * D), c.norm = pl.take(N * D),
    c.stats = pl.take(d.norm->stats_per_row * N), c.qkv = pl.take(N * d.qkv_dim()), c.att = pl.take(N * d.attn_dim()),
    c.fc = pl.take(N * d.fc_dim()), c.act = pl.take(N * d.d_ff),
    c.attention = pl.take(Attention{d.n_head, d.n_kv_head, d.head_dim}.cached_scratch_floats(threads, max_len)),
    c.last = pl.take((size_t)B * D), c.logits = pl.take((size_t)B * d.vocab_size);
    // A frozen base's GEMM products in either precision (it may change while the cache lives);
    // the decode products' operand, for the widest input.
    c.matrix = pl.take(std::max(matrix_scratch_floats(d, Precision::fp32, N), matrix_scratch_floats(d, Precision::bf16, N)));
    c.decode = pl.take((size_t)threads * decode_thread_floats(d));
    c.lora = pl.take(lora_scratch_floats(d, N, false, Precision::fp32));  // (no pullback: no rounded operands)
    const size_t qk = d.qk_norm ? N * d.qk_dim() : 0, stats = d.norm->stats_per_row * N;
    c.qk_raw = pl.take(qk), c.qk_work = pl.take(qk);
    c.qk_stats = pl.take(d.qk_norm ? stats * (d.qk_norm == 1 ? d.n_head + d.n_kv_head : 2) : 0);
    c.branch = pl.take(d.branch_buffer() ? N * D : 0), c.branch_stats = pl.take(d.post_norm ? stats : 0);
    c.post_out = pl.take(d.post_norm ? N * D : 0);
    c.floats = pl.used;
    return c;
}

size_t cache_floats(const Dims& d, int B, int max_len) {
    return cache_layout(d, B, max_len, omp_get_max_threads()).floats;
}
size_t Executor::cache_floats(int B, int max_len) const { return zoo::cache_floats(d_, B, max_len); }

void Executor::reset_cache(int B, int max_len) {
    const int threads = omp_get_max_threads();
    const CacheLayout c = cache_layout(d_, B, max_len, threads);
    ensure_rope(max_len);  // (cache_layout refused a max_len past max_seq_len)
    cache_.reset(c.floats, "KV cache");
    float* a = cache_.data;
    k_cache_ = a + c.k;
    v_cache_ = a + c.v;
    c_attention_scratch_ = a + c.attention;
    c_decode_scratch_ = a + c.decode;
    c_last_ = a + c.last;
    c_logits_ = a + c.logits;
    // The residual stream is updated in place; the norms share one output and one stats buffer.
    cached_ = LayerActs{a + c.x,  a + c.norm, a + c.stats, a + c.qkv, nullptr,    a + c.att,
                        a + c.x,  a + c.norm, a + c.stats, a + c.fc,  a + c.act,  a + c.x};
    cached_.matrix_scratch = a + c.matrix;
    cached_.lora_scratch = a + c.lora;
    cached_.qk_raw = a + c.qk_raw, cached_.qk_work = a + c.qk_work, cached_.qk_stats = a + c.qk_stats;
    cached_.attn_branch = cached_.mlp_branch = a + c.branch;
    cached_.attn_branch_stats = cached_.mlp_branch_stats = a + c.branch_stats;
    cached_.post_out = a + c.post_out;
    cache_B_ = B;
    cache_len_ = max_len;
    cache_rows_ = c.rows;
    cache_cap_.resize(d_.n_layer);
    cache_offset_.resize(d_.n_layer);
    for (size_t i = 0, at = 0; i < (size_t)d_.n_layer; i++) {
        cache_cap_[i] = cache_cap(d_, (int)i, max_len, c.rows);
        cache_offset_[i] = at;
        at += (size_t)B * d_.n_kv_head * cache_cap_[i] * d_.head_dim;
    }
    cache_threads_ = threads;
    slot_len_.assign(B, 0);
    slot_seen_.assign(B, 0);
    all_slots_.assign(B, 0), all_starts_.assign(B, 0), all_lengths_.assign(B, 0);
    chunk_ends_.assign(std::min(B, c.rows), {0, 0});
    chunk_tokens_.assign(c.rows, 0);
    chunk_positions_.assign(c.rows, 0);
    chunk_runs_.assign(std::min(B, c.rows), CacheRun{});
    decode_next_.reset(new std::atomic<int>[4 * d_.n_layer]);
}

int Executor::slot_length(int slot) const {
    if (slot < 0 || slot >= cache_B_)
        throw std::out_of_range("zoo: slot " + std::to_string(slot) + " outside the cache's " + std::to_string(cache_B_));
    return slot_len_[slot];
}

// The layers over the chunk's rows (chunk_tokens_, chunk_positions_, chunk_runs_): the residual
// stream of every row ends in cached_.out.
void Executor::cached_chunk(int rows) {
    const PositionsScope scope(positions_, chunk_positions_.data());
    TIMED(forward, embedding,
          Embedding{d_.d_model}.forward(chunk_tokens_.data(), positions_, wm_.wte, w_.wpe, cached_.out, 1, rows));
    scale_floats(cached_.out, (size_t)rows * d_.d_model, d_.embedding_scale);
    for (int i = 0; i < d_.n_layer; i++) layer_forward(i, cached_, 1, rows, LayerPass::cached);
}

const float* Executor::forward_segments(const int32_t* tokens, const int32_t* slots, const int32_t* starts,
                                        const int32_t* lengths, int S) {
    if (!k_cache_) throw std::invalid_argument("zoo: reset_cache(B, max_len) first");
    if (S < 1 || S > cache_B_)
        throw std::invalid_argument("zoo: " + std::to_string(S) + " segments for a cache of " +
                                    std::to_string(cache_B_) + " slots (1 to " + std::to_string(cache_B_) + ")");
    if (omp_get_max_threads() > cache_threads_)
        throw std::invalid_argument("zoo: " + std::to_string(omp_get_max_threads()) + " threads now, " +
                                    std::to_string(cache_threads_) + " when the cache was made: reset_cache again");
    // Checked before anything runs; nothing is allocated unless to say what is wrong.
    int64_t total = 0;
    std::fill(slot_seen_.begin(), slot_seen_.end(), 0);
    for (int s = 0; s < S; s++) {
        const int slot = slots[s], start = starts[s], len = lengths[s];
        auto refuse = [&](const std::string& why) {
            throw std::invalid_argument("zoo: segment " + std::to_string(s) + ": " + why);
        };
        if (slot < 0 || slot >= cache_B_)
            refuse("slot " + std::to_string(slot) + " outside the cache's " + std::to_string(cache_B_) + " slots");
        if (slot_seen_[slot]++) refuse("slot " + std::to_string(slot) + " twice in one call");
        if (len < 1) refuse(std::to_string(len) + " tokens");
        if (start < 0 || start > slot_len_[slot])
            refuse("position " + std::to_string(start) + ", but slot " + std::to_string(slot) + " holds " +
                   std::to_string(slot_len_[slot]) +
                   " positions (a segment continues its sequence, or rewrites part of it)");
        for (int i = 0; i < d_.n_layer; i++)  // a ring keeps the latest positions only
            if (cache_cap_[i] < cache_len_ && start < slot_len_[slot] &&
                start - d_.layer_window[i] + 1 < slot_len_[slot] - cache_cap_[i])
                refuse("position " + std::to_string(start) + " rewinds slot " + std::to_string(slot) + " (" +
                       std::to_string(slot_len_[slot]) + " positions) past what layer " + std::to_string(i) +
                       "'s windowed KV cache keeps (the last " + std::to_string(cache_cap_[i]) +
                       " positions; its window is " + std::to_string(d_.layer_window[i]) + ")");
        if ((int64_t)start + len > cache_len_)
            refuse("positions " + std::to_string(start) + ".." + std::to_string((int64_t)start + len) +
                   " exceed the cache length " + std::to_string(cache_len_));
        total += len;
    }
    check_ids(tokens, nullptr, (int)total);  // total <= B * max_len, an int
    const int d = d_.d_model, V = d_.vocab_size;
    // Rows in chunks of at most cache_rows_: each segment's positions in order, split across
    // chunks where it does not fit, so that every row finds the keys before it in the cache.
    int s = 0, done = 0;  // the segment, and how many of its rows are through
    int64_t at = 0;       // the next token
    while (s < S) {
        int rows = 0, ends = 0;
        chunk_n_runs_ = 0;
        while (s < S && rows < cache_rows_) {
            const int take = std::min(lengths[s] - done, cache_rows_ - rows);
            chunk_runs_[chunk_n_runs_++] = CacheRun{slots[s], starts[s] + done, take, rows};
            for (int t = 0; t < take; t++) {
                chunk_tokens_[rows + t] = tokens[at + t];
                chunk_positions_[rows + t] = starts[s] + done + t;
            }
            rows += take, at += take, done += take;
            if (done == lengths[s]) {  // the segment ends in this chunk, at row rows - 1
                chunk_ends_[ends++] = {s, rows - 1};
                done = 0;
                s++;
            }
        }
        if (fused_decode(rows))
            decode_chunk(rows);
        else
            cached_chunk(rows);
        for (int e = 0; e < ends; e++)
            std::memcpy(c_last_ + (size_t)chunk_ends_[e].first * d, cached_.out + (size_t)chunk_ends_[e].second * d,
                        sizeof(float) * d);
    }
    for (int k = 0; k < S; k++) slot_len_[slots[k]] = starts[k] + lengths[k];
    TIMED(forward, norm, norm_forward(c_last_, w_.lnf_w, w_.lnf_b, cached_.ln1, cached_.ln1_stats, S));
    TIMED(forward, lm_head,
          linear_forward(linear(d, V), true, cached_.ln1, head_matrix(), nullptr, c_logits_, S, nullptr,
                         cached_.matrix_scratch));
    finish_logits(c_logits_, (size_t)S * V, nullptr);
    return c_logits_;
}

const float* Executor::forward_cached(const int32_t* tokens, int B, int T, int pos0) {
    if (!k_cache_ || B != cache_B_) throw std::invalid_argument("zoo: reset_cache(B, max_len) with this batch size first");
    if (T <= 0 || pos0 < 0 || pos0 + T > cache_len_)
        throw std::invalid_argument("zoo: positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + T) +
                                    " exceed the cache length " + std::to_string(cache_len_));
    for (int b = 0; b < B; b++) all_slots_[b] = b, all_starts_[b] = pos0, all_lengths_[b] = T;
    return forward_segments(tokens, all_slots_.data(), all_starts_.data(), all_lengths_.data(), B);
}

}  // namespace zoo
