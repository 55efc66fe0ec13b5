// Each block's forward and pullback on NumPy arrays, one call each: for the per-block
// tests (finite differences, torch autograd) and the per-block benchmark. Outputs are fresh
// arrays; pullbacks that add into their adjoints get zeroed ones.
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/numpy_arrays.hpp"
#include "blocks/adamw.hpp"
#include "blocks/registry.hpp"

namespace py = pybind11;

namespace {

using namespace zoo::py_arrays;

// qkv: (B, T, (n_head + 2 n_kv_head) head_dim); returns B and T.
std::pair<int, int> attention_batch(const F& qkv, const zoo::Attention& a) {
    if (qkv.ndim() != 3 || qkv.shape(2) != a.qkv_dim())
        throw std::invalid_argument("zoo: attention qkv must be (B, T, (nh + 2 nkv) hd)");
    return {(int)qkv.shape(0), (int)qkv.shape(1)};
}

void same_shape(const F& a, const F& like, const char* what) {
    if (shape_of(a) != shape_of(like))
        throw std::invalid_argument(std::string("zoo: ") + what + " must have the input's shape");
}

// "manual" or "clad": which of a registry entry's pullbacks to run.
template <class Pullback>
Pullback chosen_pullback(Pullback manual, Pullback clad, const std::string& backend, const std::string& block) {
    if (backend != "manual" && backend != "clad") throw std::invalid_argument("zoo: backend is 'manual' or 'clad'");
    Pullback p = backend == "clad" ? clad : manual;
    if (!p) throw std::invalid_argument("zoo: block " + block + " has no " + backend + " pullback in this build");
    return p;
}

// A call on a registered norm: its registry entry, the width C and the rows of x; b present
// (with C floats) exactly when the norm has a bias.
struct NormCall {
    const zoo::NormBlock& block;
    int C, n_rows;
};

NormCall norm_call(const std::string& name, const F& x, const F& w, const std::optional<F>& b) {
    const zoo::NormBlock& norm = zoo::find_norm(name);
    const int C = (int)w.size(), N = rows(x, C, "norm x");
    if (norm.bias != (bool)b)
        throw std::invalid_argument(std::string("zoo: norm ") + norm.name + (norm.bias ? " needs" : " has no") + " bias");
    if (b && b->size() != C) throw std::invalid_argument(std::string("zoo: norm ") + norm.name + " bias must have C floats");
    return {norm, C, N};
}

// A call on a registered activation: its registry entry, its output width and the rows of x
// (rows of gate_width * width: a gated unit's rows are [gate | up]); dy, when given, must hold
// the output's rows x width.
struct ActivationCall {
    const zoo::ActivationBlock& block;
    int width, n_rows;
};

ActivationCall activation_call(const std::string& name, const F& x, const F* dy = nullptr) {
    const zoo::ActivationBlock& act = zoo::find_activation(name);
    const py::ssize_t in = x.ndim() ? x.shape(x.ndim() - 1) : 0;
    if (in % act.gate_width)
        throw std::invalid_argument(std::string("zoo: activation ") + act.name +
                                    " x: rows of [gate | up], the last dimension must be even, got " + std::to_string(in));
    const int width = (int)(in / act.gate_width), N = rows(x, width * act.gate_width, "activation x");
    if (dy && dy->size() != (py::ssize_t)N * width)
        throw std::invalid_argument("zoo: activation dy must have the output's shape");
    return {act, width, N};
}

}  // namespace

void bind_blocks(py::module_& parent) {
    py::module_ m = parent.def_submodule("blocks", "each block's forward and pullback");

    m.def("linear_forward", [](F x, F W, std::optional<F> b) {
        int out = (int)W.shape(0), in = (int)W.shape(1), N = rows(x, in, "linear x");
        F y({(py::ssize_t)N, (py::ssize_t)out});
        zoo::Linear{in, out}.forward(x.data(), W.data(), b ? b->data() : nullptr, y.mutable_data(), N);
        return y;
    });
    m.def("linear_pullback", [](F x, F W, F dy, bool has_bias) {
        int out = (int)W.shape(0), in = (int)W.shape(1), N = rows(x, in, "linear x");
        F dx({(py::ssize_t)N, (py::ssize_t)in}), dW = zeros({out, in}), db = zeros({out});
        zoo::Linear{in, out}.pullback(x.data(), W.data(), dy.data(), dx.mutable_data(),
                                      dW.mutable_data(), has_bias ? db.mutable_data() : nullptr, N, false,
                                      zoo::GradMode::add);
        return py::make_tuple(dx, dW, has_bias ? py::object(db) : py::object(py::none()));
    });
    m.def("embedding_forward", [](I tokens, F wte, std::optional<F> wpe) {
        int B = (int)tokens.shape(0), T = (int)tokens.shape(1), C = (int)wte.shape(1);
        F x({(py::ssize_t)B * T, (py::ssize_t)C});
        zoo::Embedding{C}.forward(tokens.data(), nullptr, wte.data(), wpe ? wpe->data() : nullptr,
                                  x.mutable_data(), B, T);
        return x;
    });
    m.def("embedding_pullback", [](I tokens, F dx, int vocab, int max_pos) {
        int B = (int)tokens.shape(0), T = (int)tokens.shape(1), C = (int)dx.shape(1);
        F dwte = zeros({vocab, C}), dwpe = zeros({std::max(max_pos, 1), C});
        zoo::Embedding{C}.pullback(tokens.data(), nullptr, dx.data(), dwte.mutable_data(),
                                   max_pos ? dwpe.mutable_data() : nullptr, B, T, zoo::GradMode::add,
                                   zoo::GradMode::add);
        return py::make_tuple(dwte, max_pos ? py::object(dwpe) : py::object(py::none()));
    });
    // x: (B, T, n_heads * head_dim), rotated in a copy.
    m.def("rope_forward", [](F x, F inv_freq, int head_dim) {
        int B = (int)x.shape(0), T = (int)x.shape(1), H = (int)(x.shape(2) / head_dim);
        std::vector<float> c((size_t)T * head_dim / 2), s(c.size());
        zoo::RoPE rope{head_dim};
        rope.build_tables(inv_freq.data(), c.data(), s.data(), T);
        F y(shape_of(x));
        std::copy(x.data(), x.data() + x.size(), y.mutable_data());
        rope.forward(y.mutable_data(), H * head_dim, H, c.data(), s.data(), B, T, nullptr);
        return y;
    });
    m.def("rope_pullback", [](F dy, F inv_freq, int head_dim) {
        int B = (int)dy.shape(0), T = (int)dy.shape(1), H = (int)(dy.shape(2) / head_dim);
        std::vector<float> c((size_t)T * head_dim / 2), s(c.size());
        zoo::RoPE rope{head_dim};
        rope.build_tables(inv_freq.data(), c.data(), s.data(), T);
        F dx(shape_of(dy));
        std::copy(dy.data(), dy.data() + dy.size(), dx.mutable_data());
        rope.pullback(dx.mutable_data(), H * head_dim, H, c.data(), s.data(), B, T, nullptr);
        return dx;
    });
    // positions (B, T) and hidden (B, T, 2), optional: the keys each row sees (block.hpp).
    m.def("attention_forward", [](F qkv, int n_head, int n_kv_head, int head_dim, std::optional<I> positions,
                                  std::optional<I> hidden) {
        const zoo::Attention a{n_head, n_kv_head, head_dim};
        const auto [B, T] = attention_batch(qkv, a);
        const auto [pos, hid] = key_masks(positions, hidden, B, T);
        F out({B, T, n_head * head_dim}), lse({B, n_head, T});
        std::vector<float> scratch(a.scratch_floats(omp_get_max_threads(), T));
        a.forward(qkv.data(), pos, hid, lse.mutable_data(), out.mutable_data(), scratch.data(), B, T);
        return py::make_tuple(out, lse);
    }, py::arg("qkv"), py::arg("n_head"), py::arg("n_kv_head"), py::arg("head_dim"), py::arg("positions") = py::none(),
       py::arg("hidden") = py::none());
    // lse: the forward's (B, n_head, T) log-sum-exp of each row's scaled scores.
    m.def("attention_pullback", [](F qkv, F lse, F dout, int n_head, int n_kv_head, int head_dim,
                                   std::optional<I> positions, std::optional<I> hidden) {
        const zoo::Attention a{n_head, n_kv_head, head_dim};
        const auto [B, T] = attention_batch(qkv, a);
        const auto [pos, hid] = key_masks(positions, hidden, B, T);
        if (lse.ndim() != 3 || lse.shape(0) != B || lse.shape(1) != n_head || lse.shape(2) != T)
            throw std::invalid_argument("zoo: attention lse must be (B, n_head, T)");
        if (dout.ndim() != 3 || dout.shape(0) != B || dout.shape(1) != T || dout.shape(2) != n_head * head_dim)
            throw std::invalid_argument("zoo: attention dout must be (B, T, n_head * head_dim)");
        F dqkv(shape_of(qkv));
        std::vector<float> scratch(a.pullback_scratch_floats(omp_get_max_threads(), T));
        a.pullback(qkv.data(), pos, hid, lse.data(), dout.data(), dqkv.mutable_data(), scratch.data(), B, T);
        return dqkv;
    }, py::arg("qkv"), py::arg("lse"), py::arg("dout"), py::arg("n_head"), py::arg("n_kv_head"), py::arg("head_dim"),
       py::arg("positions") = py::none(), py::arg("hidden") = py::none());
    // logits (N, V); targets (N,), each in [0, V) or ignore_index.
    auto check_cross_entropy = [](const F& logits, const I& targets) {
        if (logits.ndim() != 2 || targets.ndim() != 1 || targets.shape(0) != logits.shape(0))
            throw std::invalid_argument("zoo: cross-entropy takes logits (N, V) and targets (N,)");
        const int V = (int)logits.shape(1);
        for (py::ssize_t n = 0; n < targets.shape(0); n++) {
            const int32_t t = targets.data()[n];
            if (t != zoo::CrossEntropy::ignore_index && (t < 0 || t >= V))
                throw std::invalid_argument("zoo: target id " + std::to_string(t) + " outside the vocabulary [0, " +
                                            std::to_string(V) + ")");
        }
    };
    m.def("cross_entropy_forward", [check_cross_entropy](F logits, I targets) {
        check_cross_entropy(logits, targets);
        int V = (int)logits.shape(1), N = (int)logits.shape(0);
        F row_loss({N});
        int n_valid = 0;
        std::vector<float> work(logits.data(), logits.data() + logits.size());  // the forward works in place
        double loss = zoo::CrossEntropy{V}.forward(work.data(), targets.data(), row_loss.mutable_data(), N, &n_valid);
        return py::make_tuple(loss, n_valid);
    });
    // The executor's fused training kernel: (mean loss, counted rows, dlogits). row_weight (N,),
    // optional: each row's own adjoint (a preference step's), instead of the mean's.
    m.def("cross_entropy_forward_pullback", [check_cross_entropy](F logits, I targets, int n_valid, float grad_scale,
                                                                  std::optional<F> row_weight) {
        check_cross_entropy(logits, targets);
        int V = (int)logits.shape(1), N = (int)logits.shape(0);
        F d(shape_of(logits)), row_loss({N});
        std::copy(logits.data(), logits.data() + logits.size(), d.mutable_data());
        int counted = 0;
        double loss = zoo::CrossEntropy{V}.forward_pullback(d.mutable_data(), targets.data(), row_loss.mutable_data(),
                                                            N, n_valid, grad_scale, &counted,
                                                            row_weights(row_weight, N));
        return py::make_tuple(loss, counted, d);
    }, py::arg("logits"), py::arg("targets"), py::arg("n_valid"), py::arg("grad_scale"),
       py::arg("row_weight") = py::none());
    m.def("cross_entropy_pullback", [check_cross_entropy](F logits, I targets, int n_valid, float grad_scale) {
        check_cross_entropy(logits, targets);
        int V = (int)logits.shape(1), N = (int)logits.shape(0);
        F d(shape_of(logits)), row_loss({N});
        int counted = 0;
        std::copy(logits.data(), logits.data() + logits.size(), d.mutable_data());
        zoo::CrossEntropy{V}.forward(d.mutable_data(), targets.data(), row_loss.mutable_data(), N, &counted);
        std::copy(logits.data(), logits.data() + logits.size(), d.mutable_data());  // the forward works in place
        zoo::CrossEntropy{V}.pullback(d.mutable_data(), targets.data(), row_loss.data(), N, n_valid,
                                      grad_scale);
        return d;
    });
    m.def("residual_forward", [](F a, F b) {
        F y(shape_of(a));
        zoo::Residual{}.forward(a.data(), b.data(), y.mutable_data(), a.size());
        return y;
    });
    m.def("residual_pullback", [](F dy) {
        F da = zeros(shape_of(dy)), db = zeros(shape_of(dy));
        zoo::Residual{}.pullback(dy.data(), da.mutable_data(), db.mutable_data(), dy.size());
        return py::make_tuple(da, db);
    });

    // Any registered norm or activation by name, through its registry entry: what a new
    // block's tests call (its header and registry line are all it needs).
    m.def("norm_forward", [](const std::string& name, F x, F w, std::optional<F> b, float eps) {
        const auto [norm, C, N] = norm_call(name, x, w, b);
        F y(shape_of(x)), stats({norm.stats_per_row, N});
        norm.forward({C, eps, N, x.data(), w.data(), b ? b->data() : nullptr, stats.mutable_data()}, y.mutable_data());
        return py::make_tuple(y, stats);
    }, py::arg("name"), py::arg("x"), py::arg("w"), py::arg("b"), py::arg("eps"),
       "Returns y and the per-row statistics (stats_per_row, N).");
    // Returns (dx, dw, db or None), and with recompute=True the recomputed y last (the
    // executor's path for a norm whose output the layers share).
    m.def("norm_pullback", [](const std::string& name, F x, F w, std::optional<F> b, F stats, F dy, float eps,
                              const std::string& backend, bool recompute) {
        const auto [norm, C, N] = norm_call(name, x, w, b);
        same_shape(dy, x, "norm dy");
        if (stats.size() != (py::ssize_t)norm.stats_per_row * N)
            throw std::invalid_argument("zoo: norm " + name + " stats must be (" + std::to_string(norm.stats_per_row) +
                                        ", rows of x), as norm_forward returns them");
        const bool clad = backend == "clad";
        const zoo::NormPullback pullback = chosen_pullback(norm.pullback, norm.pullback_clad, backend, name);
        F dx = zeros(shape_of(x)), dw = zeros({C}), db = zeros({C}), y(shape_of(x));
        const zoo::ScratchFloats scratch_floats = clad ? norm.clad_scratch_floats : norm.scratch_floats;
        std::vector<float> scratch(scratch_floats ? scratch_floats(C, omp_get_max_threads()) : 0);
        std::vector<float> stats_copy(stats.data(), stats.data() + stats.size());  // a recompute writes them
        pullback({C, eps, N, x.data(), w.data(), b ? b->data() : nullptr, stats_copy.data()}, dy.data(),
                 recompute ? y.mutable_data() : nullptr, dx.mutable_data(), dw.mutable_data(),
                 norm.bias ? db.mutable_data() : nullptr, scratch.data(), zoo::GradMode::add);
        py::object db_or_none = norm.bias ? py::object(db) : py::object(py::none());
        if (recompute) return py::tuple(py::make_tuple(dx, dw, db_or_none, y));
        return py::tuple(py::make_tuple(dx, dw, db_or_none));
    }, py::arg("name"), py::arg("x"), py::arg("w"), py::arg("b"), py::arg("stats"), py::arg("dy"), py::arg("eps"),
       py::arg("backend") = "manual", py::arg("recompute") = false);
    // x: rows of gate_width * F; y: rows of F.
    m.def("activation_forward", [](const std::string& name, F x) {
        const auto [act, width, N] = activation_call(name, x);
        std::vector<py::ssize_t> shape = shape_of(x);
        shape.back() = width;
        F y(shape);
        act.forward(width, x.data(), y.mutable_data(), N);
        return y;
    }, py::arg("name"), py::arg("x"));
    m.def("activation_pullback", [](const std::string& name, F x, F dy, const std::string& backend) {
        const auto [act, width, N] = activation_call(name, x, &dy);
        const zoo::ActivationPullback pullback = chosen_pullback(act.pullback, act.pullback_clad, backend, name);
        F dx(shape_of(x));
        pullback(width, x.data(), dy.data(), dx.mutable_data(), N);
        return dx;
    }, py::arg("name"), py::arg("x"), py::arg("dy"), py::arg("backend") = "manual", "Writes dx.");
    // The executor's MLP path: y recomputed and dx, in one pass. Returns (y, dx).
    m.def("activation_recompute_and_pullback", [](const std::string& name, F x, F dy, const std::string& backend) {
        const auto [act, width, N] = activation_call(name, x, &dy);
        const zoo::ActivationRecomputePullback pullback =
            chosen_pullback(act.recompute_and_pullback, act.recompute_and_pullback_clad, backend, name);
        F y(shape_of(dy)), dx(shape_of(x));
        pullback(width, x.data(), dy.data(), y.mutable_data(), dx.mutable_data(), N);
        return py::make_tuple(y, dx);
    }, py::arg("name"), py::arg("x"), py::arg("dy"), py::arg("backend") = "manual");
    // In place on p, m, v (float32 C-contiguous arrays).
    m.def("adamw_update", [](py::array_t<float, py::array::c_style> p, py::array_t<float, py::array::c_style> g,
                             py::array_t<float, py::array::c_style> mo,
                             py::array_t<float, py::array::c_style> v, float lr, float b1, float b2,
                             float eps, float wd, int step, bool decay, float grad_scale) {
        std::vector<float> g_copy(g.data(), g.data() + g.size());  // update consumes (zeroes) it
        zoo::AdamW{lr, b1, b2, eps, wd}.update(p.mutable_data(), g_copy.data(), mo.mutable_data(),
                                               v.mutable_data(), p.size(), step, decay, grad_scale);
    });
}
