// The NumPy array helpers the per-block bindings share (block_bindings.cpp and, in a Clad
// build, clad_block_bindings.cpp).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "blocks/block.hpp"

namespace zoo::py_arrays {

namespace py = pybind11;

using F = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A fresh array of zeros, for pullbacks that add into their adjoints.
inline F zeros(std::vector<py::ssize_t> shape) {
    F a(shape);
    std::fill(a.mutable_data(), a.mutable_data() + a.size(), 0.0f);
    return a;
}

inline std::vector<py::ssize_t> shape_of(const F& x) { return {x.shape(), x.shape() + x.ndim()}; }

// Rows of x as (rows, C); an error naming the argument when the last dimension is not C.
inline int rows(const F& x, int C, const char* what) {
    if (x.ndim() < 1 || x.shape(x.ndim() - 1) != C || x.size() % C)
        throw std::invalid_argument(std::string("zoo: ") + what + ": last dimension must be " +
                                    std::to_string(C));
    return (int)(x.size() / C);
}

// Optional positions (B, T) and hidden key spans (B, T, 2) of an attention call, checked as the
// executor checks a step's (check_visible_keys): null where not given.
inline std::pair<const int32_t*, const int32_t*> key_masks(const std::optional<I>& positions,
                                                           const std::optional<I>& hidden, int B, int T) {
    if (positions && (positions->ndim() != 2 || positions->shape(0) != B || positions->shape(1) != T))
        throw std::invalid_argument("zoo: positions must be (B, T)");
    if (hidden && (hidden->ndim() != 3 || hidden->shape(0) != B || hidden->shape(1) != T || hidden->shape(2) != 2))
        throw std::invalid_argument("zoo: hidden must be (B, T, 2)");
    const int32_t* pos = positions ? positions->data() : nullptr;
    const int32_t* hid = hidden ? hidden->data() : nullptr;
    check_visible_keys(pos, hid, B, T);
    return {pos, hid};
}

// Optional per-row weights (N,) of a cross-entropy pullback: null where not given.
inline const float* row_weights(const std::optional<F>& w, int N) {
    if (w && (w->ndim() != 1 || w->shape(0) != N)) throw std::invalid_argument("zoo: row_weight must be (N,)");
    return w ? w->data() : nullptr;
}

}  // namespace zoo::py_arrays
