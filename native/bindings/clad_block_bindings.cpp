// The Clad backend's pullback of each block on NumPy arrays (a Clad build only), next to the
// hand-written ones of block_bindings.cpp: zoo._native.blocks.<block>_pullback_clad (norms and
// activations go through the registry: norm_pullback / activation_pullback(..., backend="clad")). Inputs
// and outputs follow the hand-written bindings; the Clad pullbacks replay the forward, so they
// take its inputs (b, wte, a...) instead of saved statistics. Scratch is allocated per call
// here (a test and benchmark API); the executor plans it once.
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/numpy_arrays.hpp"
#include "blocks/registry.hpp"

namespace py = pybind11;

namespace {

using namespace zoo::py_arrays;

int threads() { return omp_get_max_threads(); }

}  // namespace

void bind_clad_blocks(py::module_ m) {
    m.def("linear_pullback_clad", [](F x, F W, std::optional<F> b, F dy) {
        int out = (int)W.shape(0), in = (int)W.shape(1), N = rows(x, in, "linear x");
        zoo::Linear l{in, out};
        F dx({(py::ssize_t)N, (py::ssize_t)in}), dW = zeros({out, in}), db = zeros({out});
        std::vector<float> y(b ? l.clad_scratch_floats(N) : 0);
        l.pullback_clad(x.data(), W.data(), b ? b->data() : nullptr, dy.data(), dx.mutable_data(),
                        dW.mutable_data(), b ? db.mutable_data() : nullptr, N, false, zoo::GradMode::add, y.data());
        return py::make_tuple(dx, dW, b ? py::object(db) : py::object(py::none()));
    });
    m.def("embedding_pullback_clad", [](I tokens, F wte, std::optional<F> wpe, F dx) {
        int B = (int)tokens.shape(0), T = (int)tokens.shape(1), C = (int)wte.shape(1);
        F dwte = zeros({wte.shape(0), (py::ssize_t)C});
        F dwpe = zeros({wpe ? wpe->shape(0) : 1, (py::ssize_t)C});
        zoo::Embedding{C}.pullback_clad(tokens.data(), nullptr, wte.data(), wpe ? wpe->data() : nullptr, dx.data(),
                                        dwte.mutable_data(), wpe ? dwpe.mutable_data() : nullptr, B, T,
                                        zoo::GradMode::add, zoo::GradMode::add);
        return py::make_tuple(dwte, wpe ? py::object(dwpe) : py::object(py::none()));
    });
    // dy: (B, T, n_heads * head_dim); the adjoint is rotated back in a copy.
    m.def("rope_pullback_clad", [](F dy, F inv_freq, int head_dim) {
        int B = (int)dy.shape(0), T = (int)dy.shape(1), H = (int)(dy.shape(2) / head_dim);
        zoo::RoPE rope{head_dim};
        std::vector<float> c((size_t)T * head_dim / 2), s(c.size());
        rope.build_tables(inv_freq.data(), c.data(), s.data(), T);
        F dx(shape_of(dy));
        std::memcpy(dx.mutable_data(), dy.data(), sizeof(float) * dy.size());
        rope.pullback_clad(dx.mutable_data(), H * head_dim, H, c.data(), s.data(), B, T, nullptr);
        return dx;
    });
    m.def("attention_pullback_clad", [](F qkv, F dout, int n_head, int n_kv_head, int head_dim,
                                        std::optional<I> positions, std::optional<I> hidden) {
        int B = (int)qkv.shape(0), T = (int)qkv.shape(1);
        zoo::Attention a{n_head, n_kv_head, head_dim};
        if (qkv.ndim() != 3 || qkv.shape(2) != a.qkv_dim())
            throw std::invalid_argument("zoo: attention qkv must be (B, T, (nh + 2 nkv) hd)");
        const auto [pos, hid] = key_masks(positions, hidden, B, T);
        F dqkv(shape_of(qkv));
        std::vector<float> scratch(a.clad_scratch_floats(threads(), T));
        a.pullback_clad(qkv.data(), pos, hid, dout.data(), dqkv.mutable_data(), scratch.data(), B, T);
        return dqkv;
    }, py::arg("qkv"), py::arg("dout"), py::arg("n_head"), py::arg("n_kv_head"), py::arg("head_dim"),
       py::arg("positions") = py::none(), py::arg("hidden") = py::none());
    // As cross_entropy_forward_pullback: (mean loss, counted rows, dlogits).
    m.def("cross_entropy_forward_pullback_clad", [](F logits, I targets, int n_valid, float grad_scale,
                                                    std::optional<F> row_weight) {
        int V = (int)logits.shape(1), N = (int)logits.shape(0);
        zoo::CrossEntropy ce{V};
        F d(shape_of(logits)), row_loss({N});
        std::memcpy(d.mutable_data(), logits.data(), sizeof(float) * logits.size());
        std::vector<float> scratch(ce.clad_scratch_floats(threads()));
        int counted = 0;
        double loss = ce.forward_pullback_clad(d.mutable_data(), targets.data(), row_loss.mutable_data(), N, n_valid,
                                               grad_scale, &counted, row_weights(row_weight, N), scratch.data());
        return py::make_tuple(loss, counted, d);
    }, py::arg("logits"), py::arg("targets"), py::arg("n_valid"), py::arg("grad_scale"),
       py::arg("row_weight") = py::none());
    m.def("residual_pullback_clad", [](F a, F b, F dy) {
        F da = zeros(shape_of(dy)), db = zeros(shape_of(dy));
        zoo::Residual{}.pullback_clad(a.data(), b.data(), dy.data(), da.mutable_data(), db.mutable_data(),
                                      dy.size());
        return py::make_tuple(da, db);
    });
}
