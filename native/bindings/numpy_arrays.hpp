// The NumPy array helpers the per-block bindings share (block_bindings.cpp and, in a Clad
// build, clad_block_bindings.cpp).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

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

}  // namespace zoo::py_arrays
