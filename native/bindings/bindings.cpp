// Python bindings: one Executor object; every call below is a whole forward, pullback or
// optimizer step, run with the GIL released.
#include <cmath>
#include <omp.h>
#include <time.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "executor/alloc_count.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemv.hpp"
#include "layers/layers.hpp"

namespace py = pybind11;
using zoo::Executor;

void bind_blocks(py::module_& parent);  // block_bindings.cpp
#ifdef ZOO_CLAD
void bind_clad_blocks(py::module_ blocks);  // clad_block_bindings.cpp (Clad builds only)
#endif

namespace {

using Tokens = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

py::array_t<float> view(py::object owner, float* data, std::vector<py::ssize_t> shape) {
    std::vector<py::ssize_t> strides(shape.size());
    py::ssize_t s = sizeof(float);
    for (int i = (int)shape.size() - 1; i >= 0; i--) {
        strides[i] = s;
        s *= shape[i];
    }
    return py::array_t<float>(shape, strides, data, owner);
}

// A size field of a config as an int, refused (naming it) unless an integer within [1, bound]:
// read as a Python int first, so a value too large for an int is named, not a cast error.
int size_field(const py::dict& c, const char* field, int64_t bound) {
    const py::object v = c[field];
    if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
        throw std::invalid_argument(std::string("zoo: config field ") + field + " must be an integer, got " +
                                    py::str(py::repr(v)).cast<std::string>());
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow)
        throw std::invalid_argument(std::string("zoo: ") + field + " = " + py::str(v).cast<std::string>() +
                                    " is above zoo's bound of " + std::to_string(bound));
    zoo::limits::check_size(field, value, bound);
    return (int)value;
}

// The config's sizes, each within limits.hpp, and their products (check_dims).
zoo::Dims dims_from(const py::dict& c) {
    using namespace zoo::limits;
    zoo::Dims d;
    d.vocab_size = size_field(c, "vocab_size", max_vocab);
    d.max_seq_len = size_field(c, "max_seq_len", max_seq_len);
    d.d_model = size_field(c, "d_model", max_width);
    d.n_layer = size_field(c, "n_layer", max_layers);
    d.n_head = size_field(c, "n_head", max_width);
    d.n_kv_head = size_field(c, "n_kv_head", max_width);
    d.head_dim = size_field(c, "head_dim", max_width);
    d.d_ff = size_field(c, "d_ff", max_width);
    d.norm = &zoo::find_norm(c["norm"].cast<std::string>());
    d.mlp = &zoo::find_activation(c["mlp"].cast<std::string>());
    d.layer = &zoo::find_layer(c["layer"].cast<std::string>());
    d.rope = c["positions"].cast<std::string>() == "rope";
    d.norm_eps = c["norm_eps"].cast<float>();
    d.attention_bias = c["attention_bias"].cast<bool>();
    d.mlp_bias = c["mlp_bias"].cast<bool>();
    d.tied_embeddings = c["tied_embeddings"].cast<bool>();
    // The variants' options (zoo/arch/config.py), each at its default where the dict lacks it.
    auto opt = [&](const char* key) { return c.contains(key) && !c[key].is_none(); };
    d.attention_out_bias = opt("attention_out_bias") ? c["attention_out_bias"].cast<bool>() : d.attention_bias;
    if (opt("qk_norm")) {
        const std::string qk = c["qk_norm"].cast<std::string>();
        d.qk_norm = qk == "head" ? 1 : qk == "projection" ? 2 : 0;
        if (!d.qk_norm && qk != "none") throw std::invalid_argument("zoo: qk_norm must be none, head or projection");
    }
    if (opt("branch_norms")) {
        const std::string where = c["branch_norms"].cast<std::string>();
        if (where != "pre" && where != "post" && where != "both")
            throw std::invalid_argument("zoo: branch_norms must be pre, post or both");
        d.pre_norm = where != "post", d.post_norm = where != "pre";
    }
    d.layer_window.assign(d.n_layer, 0);
    d.layer_rope.assign(d.n_layer, 1);
    auto layer_index = [&](const py::handle& v, const char* key) {
        const int i = v.cast<int>();
        if (i < 0 || i >= d.n_layer)
            throw std::invalid_argument(std::string("zoo: ") + key + " lists layer " + std::to_string(i) + " of " +
                                        std::to_string(d.n_layer));
        return i;
    };
    if (opt("sliding_window")) {
        const int window = size_field(c, "sliding_window", max_seq_len);
        if (opt("sliding_layers"))
            for (const auto& v : c["sliding_layers"]) d.layer_window[layer_index(v, "sliding_layers")] = window;
        else
            d.layer_window.assign(d.n_layer, window);
    }
    if (opt("sliding_rope_theta"))  // the sliding layers rotate by the local table
        for (int i = 0; i < d.n_layer; i++)
            if (d.layer_window[i]) d.layer_rope[i] = 2;
    if (opt("nope_layers"))
        for (const auto& v : c["nope_layers"]) d.layer_rope[layer_index(v, "nope_layers")] = 0;
    if (opt("rotary_dim")) {
        d.rotary_dim = size_field(c, "rotary_dim", max_width);
        if (d.rotary_dim % 2 || d.rotary_dim > d.head_dim)
            throw std::invalid_argument("zoo: rotary_dim must be even and at most head_dim");
    }
    for (const char* key : {"embedding_scale", "residual_scale", "attention_scale", "logit_scale", "attention_softcap",
                            "logit_softcap"}) {
        if (!opt(key)) continue;
        const float v = c[key].cast<float>();
        if (!std::isfinite(v) || v <= 0.0f) throw std::invalid_argument(std::string("zoo: ") + key + " must be positive");
        const std::string k = key;
        (k == "embedding_scale"     ? d.embedding_scale
         : k == "residual_scale"    ? d.residual_scale
         : k == "attention_scale"   ? d.attention_scale
         : k == "logit_scale"       ? d.logit_scale
         : k == "attention_softcap" ? d.attention_softcap
                                    : d.logit_softcap) = v;
    }
    // The run's setup (zoo/arch/lora.py), absent for a trainable base without adapters.
    if (c.contains("frozen")) {
        d.frozen = c["frozen"].cast<bool>();
        d.matrix_dtype = zoo::dtype_named(c["matrix_dtype"].cast<std::string>());
        d.lora_width = c["lora_width"].cast<int>();
        d.lora_scale = c["lora_scale"].cast<float>();
        d.lora_dropout = c["lora_dropout"].cast<float>();
        d.lora_seed = c["lora_seed"].cast<uint64_t>();
        if (d.lora_width < 0 || d.lora_width > zoo::limits::max_row_floats)
            throw std::invalid_argument("zoo: lora_width outside [0, " + std::to_string(zoo::limits::max_row_floats) + "]");
    }
    zoo::check_dims(d);
    return d;
}

// A (B, T) from Python, checked in 64 bits (limits::check_batch) before it becomes two ints.
std::pair<int, int> batch_shape(int64_t B, int64_t T, const char* what) {
    zoo::limits::check_batch(B, T, what);
    return {(int)B, (int)T};
}

// tokens (B, T), and their shape as checked ints.
std::pair<int, int> check_tokens(const Tokens& t, const char* what) {
    if (t.ndim() != 2) throw std::invalid_argument(std::string("zoo: ") + what + " must be 2-D (B, T)");
    return batch_shape(t.shape(0), t.shape(1), what);
}

// An optional (B, T) array beside tokens: its data, or null when absent.
const int32_t* same_shape(const std::optional<Tokens>& a, const Tokens& tokens, const char* what) {
    if (!a) return nullptr;
    check_tokens(*a, what);
    if (a->shape(0) != tokens.shape(0) || a->shape(1) != tokens.shape(1))
        throw std::invalid_argument(std::string("zoo: ") + what + " must have the shape of tokens");
    return a->data();
}
const int32_t* same_shape(const Tokens& a, const Tokens& tokens, const char* what) {
    return same_shape(std::optional<Tokens>(a), tokens, what);
}

// Optional hidden key spans (B, T, 2) beside tokens: their data, or null when absent.
const int32_t* key_spans(const std::optional<Tokens>& hidden, const Tokens& tokens) {
    if (!hidden) return nullptr;
    if (hidden->ndim() != 3 || hidden->shape(0) != tokens.shape(0) || hidden->shape(1) != tokens.shape(1) ||
        hidden->shape(2) != 2)
        throw std::invalid_argument("zoo: hidden must be (B, T, 2), beside tokens (B, T)");
    return hidden->data();
}

// A preference step's selected rows and their targets: 1-D, of one length.
int selection(const Tokens& rows, const Tokens& targets) {
    if (rows.ndim() != 1 || targets.ndim() != 1 || rows.shape(0) != targets.shape(0))
        throw std::invalid_argument("zoo: rows and targets must be 1-D of one length");
    return (int)rows.shape(0);
}

// checkpointing as Python gives it: a bool (every layer or none), or the number of layers
// checkpointed from the first.
int checkpoint_layers(const zoo::Dims& d, py::handle v) {
    if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? d.n_layer : 0;
    return v.cast<int>();
}

// A plan as Python sees it: one dict per buffer.
// bytes of buf, 64-byte aligned (as the kernels read a stored matrix), sized to hold them.
void* aligned_bytes(std::vector<uint8_t>& buf, size_t bytes) {
    buf.resize(bytes + 64);
    return buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
}

py::list plan_list(const std::vector<zoo::PlannedBuffer>& buffers) {
    py::list out;
    for (const auto& b : buffers)
        out.append(py::dict(py::arg("name") = b.name, py::arg("floats") = b.floats, py::arg("live") = b.live,
                            py::arg("offset") = b.offset));
    return out;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "zoo's native core: blocks, executor, optimizer";
    // The vector path, resolved at import: its first call asks oneDNN for its class, which starts
    // oneDNN (448 KiB to 2.2 MiB of its pages made resident). Left to the first step that widens a
    // stored matrix, that step's peak outgrew the memory estimate on CPUs without bf16 (where no
    // bf16 product starts oneDNN before it).
    zoo::vector_isa();
    // An arena the system would not map is a MemoryError (with the arena and its size named).
    py::register_exception<zoo::AllocationError>(m, "AllocationError", PyExc_MemoryError);
    // The bounds of limits.hpp, which zoo/arch/config.py and zoo/train/config.py check first.
    m.attr("limits") = py::dict(
        py::arg("max_layers") = zoo::limits::max_layers, py::arg("max_width") = zoo::limits::max_width,
        py::arg("max_row_floats") = zoo::limits::max_row_floats, py::arg("max_vocab") = zoo::limits::max_vocab,
        py::arg("max_seq_len") = zoo::limits::max_seq_len,
        py::arg("max_tensor_floats") = zoo::limits::max_tensor_floats,
        py::arg("max_tokens") = zoo::limits::max_tokens);
    bind_blocks(m);
#ifdef ZOO_CLAD
    bind_clad_blocks(m.attr("blocks").cast<py::module_>());
#endif

    m.def("set_threads", [](int n) {
        if (n < 1) throw std::invalid_argument("zoo: threads must be >= 1");
        omp_set_num_threads(n);
        zoo::gemm::set_threads(n);
    });
    // The GEMM libraries (gemm.hpp): which fp32 products run on, and what bf16 can do here.
    m.def("set_gemm_library", &zoo::gemm::set_fp32_library, py::arg("name"),
          "The library fp32 products run on in this process: openblas, mkl or onednn where built in; auto: "
          "the measured fastest for this CPU.");
    m.def("gemm_info", []() {
        std::vector<std::string> built;
        for (auto l : zoo::gemm::built_in()) built.push_back(zoo::gemm::name(l));
        return py::dict(py::arg("fp32") = zoo::gemm::name(zoo::gemm::fp32_library()),
                        py::arg("fp32_default") = zoo::gemm::name(zoo::gemm::default_fp32_library()),
                        py::arg("bf16") = zoo::gemm::bf16_built() ? py::object(py::str("onednn")) : py::object(py::none()),
                        py::arg("built_in") = built, py::arg("bf16_native") = zoo::gemm::bf16_native(),
                        py::arg("cpu_vendor") = zoo::gemm::cpu_vendor(), py::arg("onednn_isa") = zoo::gemm::cpu_isa(),
                        py::arg("vector_isa") = zoo::vector_isa_name(zoo::vector_isa()),
                        py::arg("cpu_vector_isa") = zoo::vector_isa_name(zoo::cpu_vector_isa()),
                        py::arg("openblas_core") = zoo::gemm::openblas_core(),
                        py::arg("openblas_threads") = zoo::gemm::openblas_threads());
    });
    // zoo's own conversion loops (isa.hpp): forced to a path for tests, "auto" for the default.
    m.def("set_vector_isa", &zoo::set_vector_isa, py::arg("name"));
    m.def("round_bf16", [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        py::array_t<uint16_t> out(x.size());
        zoo::to_bf16_row(x.data(), out.mutable_data(), (size_t)x.size());
        return out;
    }, py::arg("x"), "x (flattened) rounded to bf16 bits on the current vector path.");
    m.def("widen", [](py::array_t<float, py::array::c_style | py::array::forcecast> w, const std::string& format,
                      bool to_bf16) {
        if (w.ndim() != 2) throw std::invalid_argument("zoo: widen takes a 2-D matrix");
        const int rows = (int)w.shape(0), cols = (int)w.shape(1);
        const zoo::DType t = zoo::dtype_named(format);
        std::vector<uint8_t> stored;
        void* data = aligned_bytes(stored, zoo::storage_bytes(t, rows, cols));
        zoo::store_rows(t, rows, cols, 0, rows, w.data(), data);
        const zoo::Matrix W(data, t, rows, cols);
        if (to_bf16) {
            py::array_t<uint16_t> out({rows, cols});
            zoo::widen_rows_bf16(W, 0, rows, out.mutable_data());
            return py::object(out);
        }
        py::array_t<float> out({rows, cols});
        zoo::widen_rows(W, 0, rows, out.mutable_data());
        return py::object(out);
    }, py::arg("w"), py::arg("format"), py::arg("to_bf16") = false,
       "w stored in a weight format, then widened back (to fp32, or bf16 bits) on the current vector path.");
    // One product through gemm.hpp, for tests and zoo.tools.bench_gemm: A and B as stored
    // (A (M,K), or (K,M) with trans_a; B (K,N), or (N,K) with trans_b); C = op(A) op(B), or
    // added into c (returned) when given.
    using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
    m.def("gemm", [](F32 A, F32 B, bool trans_a, bool trans_b, const std::string& precision, std::optional<F32> c,
                     bool allow_emulated) {
        if (A.ndim() != 2 || B.ndim() != 2) throw std::invalid_argument("zoo: gemm takes 2-D operands");
        const int M = (int)(trans_a ? A.shape(1) : A.shape(0)), K = (int)(trans_a ? A.shape(0) : A.shape(1));
        const int N = (int)(trans_b ? B.shape(0) : B.shape(1));
        if ((trans_b ? B.shape(1) : B.shape(0)) != K) throw std::invalid_argument("zoo: gemm operands do not match");
        F32 C = c ? *c : F32({M, N});
        if (C.ndim() != 2 || C.shape(0) != M || C.shape(1) != N) throw std::invalid_argument("zoo: gemm c has the wrong shape");
        const zoo::Precision p = zoo::precision_named(precision);
        if (!allow_emulated || !zoo::gemm::bf16_built()) zoo::gemm::require_precision(p);
        {
            py::gil_scoped_release nogil;
            zoo::gemm::gemm(p, trans_a, trans_b, M, N, K, A.data(), (int)A.shape(1), B.data(), (int)B.shape(1),
                            c ? 1.0f : 0.0f, C.mutable_data(), N);
        }
        return C;
    }, py::arg("a"), py::arg("b"), py::arg("trans_a") = false, py::arg("trans_b") = false,
       py::arg("precision") = "fp32", py::arg("c") = py::none(), py::arg("allow_emulated") = false,
       "allow_emulated: run bf16 on a CPU without bf16 dot products too (oneDNN emulates them), to measure it.");
    // One product with a stored matrix (gemm::matrix_xwt / matrix_xw), for tests and benchmarks:
    // W (rows, cols) is stored in format first (not timed: repeats reuse it); then
    // x (M, cols) W^T, or with backward, dy (M, rows) W, repeated `repeats` times; returns the
    // result and the seconds of the fastest repeat. With `add_to` (the result's shape), the
    // product is added to a copy of it (beta 1: a bias or residual there), once. packed: a
    // backward product reads W's packed copy (gemm::pack_xw), made first.
    m.def("stored_matrix_product", [](F32 a, F32 w, const std::string& format, const std::string& precision,
                                      bool backward, int repeats, std::optional<F32> add_to, bool packed) {
        if (a.ndim() != 2 || w.ndim() != 2) throw std::invalid_argument("zoo: 2-D operands");
        const int rows = (int)w.shape(0), cols = (int)w.shape(1), M = (int)a.shape(0);
        if (a.shape(1) != (backward ? rows : cols)) throw std::invalid_argument("zoo: operands do not match");
        const zoo::DType t = zoo::dtype_named(format);
        const zoo::Precision p = zoo::precision_named(precision);
        zoo::gemm::require_precision(p);
        std::vector<uint8_t> stored;
        void* data = aligned_bytes(stored, zoo::storage_bytes(t, rows, cols));
        zoo::store_rows(t, rows, cols, 0, rows, w.data(), data);
        zoo::Matrix W(data, t, rows, cols);
        std::vector<uint8_t> packed_copy;
        if (packed) {
            const size_t bytes = zoo::gemm::packed_xw_bytes(W);
            if (!bytes) throw std::invalid_argument("zoo: no packed layout for a " + format + " matrix on this CPU");
            void* at = aligned_bytes(packed_copy, bytes);
            zoo::gemm::pack_xw(W, at);
            W.packed_xw = at;
        }
        std::vector<float> scratch(zoo::gemm::matrix_scratch_floats(p, t, M, rows, cols) + 1);
        F32 out({M, backward ? cols : rows});
        const float beta = add_to ? 1.0f : 0.0f;
        if (add_to) {
            if (add_to->ndim() != 2 || add_to->shape(0) != out.shape(0) || add_to->shape(1) != out.shape(1))
                throw std::invalid_argument("zoo: add_to must have the result's shape");
            std::memcpy(out.mutable_data(), add_to->data(), sizeof(float) * out.size());
            repeats = 1;
        }
        double best = 1e30;
        {
            py::gil_scoped_release nogil;
            for (int r = 0; r < std::max(1, repeats); r++) {
                const double t0 = omp_get_wtime();
                if (backward)
                    zoo::gemm::matrix_xw(p, M, a.data(), rows, W, beta, out.mutable_data(), cols, scratch.data());
                else
                    zoo::gemm::matrix_xwt(p, M, a.data(), cols, W, beta, out.mutable_data(), rows, scratch.data());
                best = std::min(best, omp_get_wtime() - t0);
            }
        }
        return py::make_tuple(out, best);
    }, py::arg("a"), py::arg("w"), py::arg("format"), py::arg("precision") = "fp32", py::arg("backward") = false,
       py::arg("repeats") = 1, py::arg("add_to") = std::nullopt, py::arg("packed") = false);
    // One decode product (gemv.hpp) with W stored in format first: x (M <= 8, cols) W^T + bias +
    // residual on the instruction set named, repeated `repeats` times (parallel: over the
    // threads, as generation runs it); returns the result, the seconds of the fastest repeat, and
    // the calling thread's CPU seconds in its fastest repeat (the work itself where parallel is
    // false: a shared machine's other processes do not count).
    m.def("decode_product", [](F32 x, F32 w, const std::string& format, const std::string& precision,
                               const std::string& isa, std::optional<F32> bias, std::optional<F32> residual,
                               int repeats, bool parallel) {
        if (x.ndim() != 2 || w.ndim() != 2) throw std::invalid_argument("zoo: 2-D operands");
        const int rows = (int)w.shape(0), cols = (int)w.shape(1), M = (int)x.shape(0);
        if (x.shape(1) != cols) throw std::invalid_argument("zoo: operands do not match");
        if (bias && (bias->ndim() != 1 || bias->shape(0) != rows)) throw std::invalid_argument("zoo: bias of rows");
        if (residual && (residual->ndim() != 2 || residual->shape(0) != M || residual->shape(1) != rows))
            throw std::invalid_argument("zoo: residual of (M, rows)");
        const zoo::DType t = zoo::dtype_named(format);
        const zoo::Precision p = zoo::precision_named(precision);
        const zoo::gemv::Isa set = zoo::gemv::isa_named(isa);
        std::vector<uint8_t> stored;
        void* data = aligned_bytes(stored, zoo::storage_bytes(t, rows, cols));
        zoo::store_rows(t, rows, cols, 0, rows, w.data(), data);
        const zoo::Matrix W(data, t, rows, cols);
        std::vector<float> scratch(zoo::gemv::scratch_floats(std::max(1, M), cols));
        F32 out({M, rows});
        double best = 1e30, best_cpu = 1e30;
        auto thread_cpu = [] {  // this thread's CPU time: the work of a product on it alone (parallel false)
            timespec ts;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
            return ts.tv_sec + 1e-9 * ts.tv_nsec;
        };
        {
            py::gil_scoped_release nogil;
            for (int r = 0; r < std::max(1, repeats); r++) {
                const double t0 = omp_get_wtime(), c0 = thread_cpu();
                zoo::gemv::product(p, M, x.data(), cols, W, bias ? bias->data() : nullptr,
                                   residual ? residual->data() : nullptr, rows, out.mutable_data(), rows,
                                   scratch.data(), set, parallel);
                best = std::min(best, omp_get_wtime() - t0);
                best_cpu = std::min(best_cpu, thread_cpu() - c0);
            }
        }
        return py::make_tuple(out, best, best_cpu);
    }, py::arg("x"), py::arg("w"), py::arg("format"), py::arg("precision") = "fp32", py::arg("isa") = "scalar",
       py::arg("bias") = py::none(), py::arg("residual") = py::none(), py::arg("repeats") = 1,
       py::arg("parallel") = true);
    m.def("decode_isas", []() {
        std::vector<std::string> out;
        for (zoo::gemv::Isa isa : zoo::gemv::isas()) out.push_back(zoo::gemv::isa_name(isa));
        return out;
    }, "The instruction sets the decode products can run on here (built in and supported), scalar first.");
    m.def("gemm_kernel", [](const std::string& precision, bool trans_a, bool trans_b, int M, int N, int K,
                            bool bf16_operands) {
        return zoo::gemm::kernel(zoo::precision_named(precision), trans_a, trans_b, M, N, K, bf16_operands);
    }, py::arg("precision"), py::arg("trans_a"), py::arg("trans_b"), py::arg("M"), py::arg("N"), py::arg("K"),
       py::arg("bf16_operands") = false);
    m.def("is_bf16_kernel", &zoo::gemm::is_bf16_kernel, py::arg("kernel"),
          "Whether a kernel (as gemm_kernel names it) runs on bf16 dot products here.");
    m.def("gemm_kernels_used", [](bool reset) {
        py::list out;
        for (const auto& u : zoo::gemm::kernels_used())
            out.append(py::dict(py::arg("precision") = zoo::precision_name(u.precision), py::arg("trans_a") = u.trans_a,
                                py::arg("trans_b") = u.trans_b, py::arg("M") = u.M, py::arg("N") = u.N,
                                py::arg("K") = u.K, py::arg("bf16_operands") = u.bf16_operands,
                                py::arg("kernel") = u.kernel, py::arg("bf16_kernel") = zoo::gemm::is_bf16_kernel(u.kernel),
                                py::arg("calls") = u.calls));
        if (reset) zoo::gemm::reset_kernels_used();
        return out;
    }, py::arg("reset") = false,
       "The oneDNN products run since the last reset: shape, kernel, whether it is a bf16 kernel, calls.");
    m.def("gemm_primitive_cache", []() { return zoo::gemm::primitive_cache_entries(); },
          "(primitives kept, the most kept): oneDNN primitives, one per product shape and form.");
    m.def("require_precision", [](const std::string& p) { zoo::gemm::require_precision(zoo::precision_named(p)); },
          "Raises, naming what is missing, where a precision cannot run well here.");
    m.def("get_threads", []() { return omp_get_max_threads(); });
    m.def("build_info", []() {
        py::dict info;
#ifdef __clang__
        info["compiler"] = std::string("clang ") + __clang_version__;
#else
        info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
        info["openmp"] = _OPENMP;
        // The Clad backend: which blocks can take Clad's pullback (zoo.Model(ad=...)).
        info["clad"] = zoo::clad_built;
#ifdef ZOO_CLAD
        info["clad_version"] = ZOO_CLAD_VERSION;
#endif
        // The registry: every block, what a config may name, and what the layout needs of them.
        py::list blocks;
        std::vector<std::string> clad, manual;
        for (const auto& b : zoo::ad_block_infos()) {
            blocks.append(py::dict(py::arg("name") = b.name, py::arg("kind") = b.kind, py::arg("manual") = b.manual,
                                   py::arg("clad") = b.clad, py::arg("in_step") = b.in_step));
            if (b.clad) clad.push_back(b.name);
            if (b.manual) manual.push_back(b.name);
        }
        info["blocks"] = blocks;
        info["clad_blocks"] = clad;
        info["manual_blocks"] = manual;
        py::dict norms, activations;
        for (const zoo::NormBlock* n : zoo::norm_blocks)
            norms[n->name] = py::dict(py::arg("bias") = n->bias, py::arg("stats_per_row") = n->stats_per_row);
        for (const zoo::ActivationBlock* a : zoo::activation_blocks)
            activations[a->name] = py::dict(py::arg("gate_width") = a->gate_width);
        info["norms"] = norms;
        info["activations"] = activations;
        // Layer arrangements: trainable where this build has their pullback (Clad's, for all but
        // the executor's own sequential layer).
        py::dict layers;
        for (const zoo::LayerArrangement* l : zoo::layer_arrangements)
            layers[l->name] = py::dict(py::arg("second_norm") = l->second_norm,
                                       py::arg("parallel") = l->parallel, py::arg("trainable") = true);
        info["layers"] = layers;
        // The roles a layout table may bind (zoo/arch/layout.py names its tensors' roles from these).
        std::vector<std::string> model_roles, layer_roles;
#define ZOO_MODEL_ROLE_NAME(r) model_roles.push_back(#r);
#define ZOO_LAYER_ROLE_NAME(r) layer_roles.push_back(#r);
        ZOO_MODEL_ROLES(ZOO_MODEL_ROLE_NAME)
        ZOO_LAYER_ROLES(ZOO_LAYER_ROLE_NAME)
#undef ZOO_MODEL_ROLE_NAME
#undef ZOO_LAYER_ROLE_NAME
        std::vector<std::string> matrix_roles, lora_slots;
#define ZOO_MATRIX_ROLE_NAME(r) matrix_roles.push_back(#r);
#define ZOO_LORA_SLOT_NAME(s) lora_slots.push_back(#s);
        ZOO_MODEL_MATRICES(ZOO_MATRIX_ROLE_NAME)
        ZOO_LAYER_MATRICES(ZOO_MATRIX_ROLE_NAME)
        ZOO_LORA_SLOTS(ZOO_LORA_SLOT_NAME)
#undef ZOO_MATRIX_ROLE_NAME
#undef ZOO_LORA_SLOT_NAME
        // matrices: the roles a frozen base may store narrower than fp32 (quant.hpp).
        info["roles"] = py::dict(py::arg("model") = model_roles, py::arg("layer") = layer_roles,
                                 py::arg("matrices") = matrix_roles, py::arg("lora_slots") = lora_slots);
        return info;
    });

    m.def("cache_floats", [](py::dict cfg, int64_t batch, int64_t max_len) {
        const auto [B, T] = batch_shape(batch, max_len, "cache_floats");
        return zoo::cache_floats(dims_from(cfg), B, T);
    }, py::arg("config"), py::arg("batch_size"), py::arg("max_len"),
       "Floats of the generation arena (KV cache and buffers) for up to batch_size x max_len tokens.");
    m.def("storage_bytes", [](const std::string& format, size_t rows, size_t cols) {
        return zoo::storage_bytes(zoo::dtype_named(format), rows, cols);
    }, py::arg("format"), py::arg("rows"), py::arg("cols"),
       "Bytes a frozen (rows, cols) matrix takes in a weight format (fp32, bf16, int8, nf4), scales included.");
    m.def("packed_matrix_bytes", [](size_t rows, size_t cols) {
        if (rows > INT32_MAX || cols > INT32_MAX) throw std::invalid_argument("zoo: a matrix of at most 2^31 - 1 rows and columns");
        return zoo::gemm::packed_xw_bytes(zoo::Matrix(nullptr, zoo::DType::bf16, (int)rows, (int)cols));
    }, py::arg("rows"), py::arg("cols"),
       "Bytes a bf16 (rows, cols) frozen matrix's packed copy takes (Executor.set_packed_base); 0 where this CPU "
       "has no packed layout for it.");
    m.def("activation_floats", [](py::dict cfg, int64_t batch, int64_t seq, py::object checkpointing,
                                  std::vector<std::string> clad_blocks, const std::string& precision) {
        const zoo::Dims d = dims_from(cfg);
        const auto [B, T] = batch_shape(batch, seq, "activation_floats");
        return zoo::activation_floats(d, checkpoint_layers(d, checkpointing), zoo::precision_named(precision), B, T,
                                      zoo::ad_choice(d, clad_blocks));
    }, py::arg("config"), py::arg("batch_size"), py::arg("seq_len"), py::arg("checkpointing") = false,
       py::arg("clad_blocks") = std::vector<std::string>{}, py::arg("precision") = "fp32");
    m.def("activation_plan", [](py::dict cfg, int64_t batch, int64_t seq, py::object checkpointing,
                                std::vector<std::string> clad_blocks, const std::string& precision) {
        const zoo::Dims d = dims_from(cfg);
        const auto [B, T] = batch_shape(batch, seq, "activation_plan");
        return plan_list(zoo::plan_activations(d, checkpoint_layers(d, checkpointing), zoo::precision_named(precision),
                                               zoo::ad_choice(d, clad_blocks), B, T, nullptr, nullptr).buffers);
    }, py::arg("config"), py::arg("batch_size"), py::arg("seq_len"), py::arg("checkpointing") = false,
       py::arg("clad_blocks") = std::vector<std::string>{}, py::arg("precision") = "fp32",
       "The training step's activation buffers: name, floats, live (phase bits: 1 forward, 2 head, "
       "4 pullback) and offset in floats.");
    // The planner on its own, for its tests: buffers as (name, floats, live).
    m.def("place_buffers", [](std::vector<std::tuple<std::string, size_t, unsigned>> buffers) {
        zoo::LivenessPlanner pl;
        for (auto& [name, floats, live] : buffers) pl.add(name, floats, live);
        pl.place();
        pl.check();
        return plan_list(pl.buffers());
    });
    // Raises if two buffers live in a common phase overlap: buffers as (name, floats, live, offset).
    m.def("check_buffer_plan", [](std::vector<std::tuple<std::string, size_t, unsigned, size_t>> buffers) {
        std::vector<zoo::PlannedBuffer> plan;
        for (auto& [name, floats, live, offset] : buffers) plan.push_back({name, floats, live, offset});
        zoo::LivenessPlanner::check_buffers(plan);
    });

    py::class_<Executor>(m, "Executor")
        .def(py::init([](py::dict cfg, size_t n_params, std::vector<std::tuple<std::string, int, size_t, size_t>> table,
                         std::vector<float> inv_freq,
                         std::vector<std::tuple<std::string, int, size_t, size_t, std::string>> frozen_table,
                         std::vector<std::tuple<std::string, int, int, int, int, size_t, size_t>> adapter_table,
                         std::vector<float> inv_freq_local) {
                 std::vector<zoo::ParamBinding> layout;
                 for (auto& [role, layer, offset, count] : table) layout.push_back({role, layer, offset, count});
                 std::vector<zoo::FrozenBinding> frozen;
                 for (auto& [role, layer, rows, cols, dtype] : frozen_table)
                     frozen.push_back({role, layer, rows, cols, zoo::dtype_named(dtype)});
                 std::vector<zoo::AdapterBinding> adapters;
                 for (auto& [slot, layer, o0, o1, rank, a_off, b_off] : adapter_table)
                     adapters.push_back({slot, layer, o0, o1, rank, a_off, b_off});
                 return new Executor(dims_from(cfg), n_params, layout, frozen, adapters, inv_freq, inv_freq_local);
             }),
             py::arg("config"), py::arg("n_params"), py::arg("layout"), py::arg("inv_freq"),
             py::arg("frozen") = std::vector<std::tuple<std::string, int, size_t, size_t, std::string>>{},
             py::arg("adapters") = std::vector<std::tuple<std::string, int, int, int, int, size_t, size_t>>{},
             py::arg("inv_freq_local") = std::vector<float>{},
             "inv_freq_local: the sliding layers' own RoPE frequencies (sliding_rope_theta), or none. "
             "layout: the trainable tensors, rows of (role, layer, offset, count) (zoo/arch/layout.py); frozen: a "
             "frozen base's tensors, rows of (role, layer, rows, cols, format); adapters: rows of (slot, layer, "
             "o0, o1, rank, A offset, B offset) (zoo/arch/lora.py).")
        .def("store_base", [](Executor& e, size_t index, size_t first_row,
                              py::array_t<float, py::array::c_style | py::array::forcecast> values) {
                 const zoo::FrozenBinding& f = e.base_binding(index);
                 if ((size_t)values.size() % f.cols)
                     throw std::invalid_argument("zoo: " + std::to_string(values.size()) + " values are no whole rows of " +
                                                 std::to_string(f.cols) + " for frozen tensor " + f.role);
                 const size_t rows = values.size() / f.cols;
                 const float* data = values.data();
                 py::gil_scoped_release nogil;
                 e.store_base(index, first_row, rows, data);
             }, py::arg("index"), py::arg("first_row"), py::arg("values"),
             "Stores rows [first_row, ...) of the frozen base's tensor index (table order) from fp32 values, "
             "in the tensor's format.")
        .def("load_base", [](Executor& e, size_t index, size_t first_row, size_t rows) {
                 const zoo::FrozenBinding& f = e.base_binding(index);
                 py::array_t<float> out({(py::ssize_t)rows, (py::ssize_t)f.cols});
                 float* data = out.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     e.load_base(index, first_row, rows, data);
                 }
                 return out;
             }, py::arg("index"), py::arg("first_row"), py::arg("rows"),
             "Rows of the frozen base's tensor index as fp32 (rows, cols).")
        .def("map_base", &Executor::map_base, py::arg("index"), py::arg("path"), py::arg("offset"), py::arg("what"),
             "The frozen matrix index read from bytes [offset, ...) of the file at path, mapped (fp32 or bf16, "
             "as stored there): resident only where a pass reads it. what names it in errors.")
        .def("arena_bytes", [](Executor& e) {
            py::dict out;
            for (const auto& [name, bytes] : e.arena_bytes()) out[py::str(name)] = bytes;
            return out;
        })
        .def("has_grads", &Executor::has_grads)
        .def("params", [](py::object self) {
            auto& e = self.cast<Executor&>();
            return view(self, e.params(), {(py::ssize_t)e.n_params()});
        })
        .def("grads", [](py::object self) {
            auto& e = self.cast<Executor&>();
            return view(self, e.grads(), {(py::ssize_t)e.n_params()});
        })
        // The moments of the parameters [begin, end) of moment_range() (mapped at this first use).
        .def("adam_m", [](py::object self) {
            auto& e = self.cast<Executor&>();
            return view(self, e.adam_m(), {(py::ssize_t)e.moment_floats()});
        })
        .def("adam_v", [](py::object self) {
            auto& e = self.cast<Executor&>();
            return view(self, e.adam_v(), {(py::ssize_t)e.moment_floats()});
        })
        .def("moment_range", [](Executor& e) { return std::make_pair(e.moment_begin(), e.moment_end()); })
        .def("set_moment_range", &Executor::set_moment_range, py::arg("begin"), py::arg("end"))
        .def("activation_floats", [](Executor& e, int64_t batch, int64_t seq) {
            const auto [B, T] = batch_shape(batch, seq, "activation_floats");
            return e.activation_floats(B, T);
        })
        .def("activation_plan", [](Executor& e) { return plan_list(e.activation_plan().buffers); })
        .def("set_poison_dead_buffers", &Executor::set_poison_dead_buffers)
        .def("forward",
             [](Executor& e, Tokens tokens, std::optional<Tokens> targets, std::optional<Tokens> positions,
                std::optional<Tokens> hidden) {
                 const auto [B, T] = check_tokens(tokens, "tokens");
                 const int32_t* tg = same_shape(targets, tokens, "targets");
                 const int32_t* pos = same_shape(positions, tokens, "positions");
                 const int32_t* hid = key_spans(hidden, tokens);
                 py::gil_scoped_release nogil;
                 return e.forward(tokens.data(), tg, pos, hid, B, T);
             },
             py::arg("tokens"), py::arg("targets") = py::none(), py::arg("positions") = py::none(),
             py::arg("hidden") = py::none())
        .def("logits", [](py::object self, int64_t B, int64_t T) {
            auto& e = self.cast<Executor&>();
            batch_shape(B, T, "logits");
            if ((size_t)(B * T) * e.dims().vocab_size > e.logits_floats())
                throw std::invalid_argument("zoo: logits(" + std::to_string(B) + ", " + std::to_string(T) +
                                            ") is larger than the last forward's logits");
            return view(self, const_cast<float*>(e.logits()), {(py::ssize_t)B, (py::ssize_t)T, e.dims().vocab_size});
        })
        .def("forward_backward",
             [](Executor& e, Tokens tokens, Tokens targets, float grad_scale, std::optional<Tokens> positions,
                std::optional<Tokens> hidden) {
                 const auto [B, T] = check_tokens(tokens, "tokens");
                 same_shape(targets, tokens, "targets");
                 const int32_t* pos = same_shape(positions, tokens, "positions");
                 const int32_t* hid = key_spans(hidden, tokens);
                 py::gil_scoped_release nogil;
                 return e.forward_backward(tokens.data(), targets.data(), pos, hid, B, T, grad_scale);
             },
             py::arg("tokens"), py::arg("targets"), py::arg("grad_scale"), py::arg("positions") = py::none(),
             py::arg("hidden") = py::none())
        // A preference step's halves (Executor::select_forward): the selected rows' cross-entropy.
        .def("select_forward",
             [](Executor& e, Tokens tokens, std::optional<Tokens> positions, std::optional<Tokens> hidden, Tokens rows,
                Tokens targets, bool train) {
                 const auto [B, T] = check_tokens(tokens, "tokens");
                 const int32_t* pos = same_shape(positions, tokens, "positions");
                 const int32_t* hid = key_spans(hidden, tokens);
                 const int n = selection(rows, targets);
                 py::array_t<float> row_loss(n);
                 float* out = row_loss.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     e.select_forward(tokens.data(), pos, hid, rows.data(), targets.data(), n, B, T, train, out);
                 }
                 return row_loss;
             },
             py::arg("tokens"), py::arg("positions"), py::arg("hidden"), py::arg("rows"), py::arg("targets"),
             py::arg("train"))
        .def("select_backward",
             [](Executor& e, py::array_t<float, py::array::c_style | py::array::forcecast> row_weight,
                float grad_scale) {
                 if (row_weight.ndim() != 1) throw std::invalid_argument("zoo: row_weight must be 1-D");
                 py::gil_scoped_release nogil;
                 e.select_backward(row_weight.data(), grad_scale);
             },
             py::arg("row_weight"), py::arg("grad_scale"))
        .def("set_adapters_enabled", &Executor::set_adapters_enabled)
        .def("adapters_enabled", &Executor::adapters_enabled)
        // A test instrument (tests/test_no_allocation.py): the C++ heap allocations made by
        // `steps` training steps (zero_grads, forward_backward, adamw_step), counted inside the
        // native calls, where pybind11's own argument handling is not.
        .def("count_step_allocations",
             [](Executor& e, Tokens tokens, Tokens targets, int steps) {
                 const auto [B, T] = check_tokens(tokens, "tokens");
                 same_shape(targets, tokens, "targets");
                 py::gil_scoped_release nogil;
                 zoo::count_allocations(true);
                 for (int i = 0; i < steps; i++) {
                     e.zero_grads();
                     e.forward_backward(tokens.data(), targets.data(), nullptr, nullptr, B, T, 1.0f);
                     e.adamw_step(1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, -1.0);
                 }
                 const long n = zoo::allocations_counted();
                 zoo::count_allocations(false);
                 return n;
             },
             py::arg("tokens"), py::arg("targets"), py::arg("steps"))
        // The allocations the last count_*_allocations call saw inside oneDNN's primitive
        // execution, which zoo's count leaves out, and how many executions there were.
        .def_static("library_allocations",
                    []() { return py::make_tuple(zoo::library_allocations_counted(), zoo::library_calls_counted()); })
        // The same for a preference step: select_forward, select_backward (row weights 1), AdamW.
        .def("count_select_step_allocations",
             [](Executor& e, Tokens tokens, Tokens positions, Tokens hidden, Tokens rows, Tokens targets, int steps) {
                 const auto [B, T] = check_tokens(tokens, "tokens");
                 same_shape(positions, tokens, "positions");
                 key_spans(hidden, tokens);
                 const int n = selection(rows, targets);
                 std::vector<float> row_loss(n), weight(n, 1.0f);
                 py::gil_scoped_release nogil;
                 zoo::count_allocations(true);
                 for (int i = 0; i < steps; i++) {
                     e.zero_grads();
                     e.select_forward(tokens.data(), positions.data(), hidden.data(), rows.data(), targets.data(), n,
                                      B, T, true, row_loss.data());
                     e.select_backward(weight.data(), 1.0f);
                     e.adamw_step(1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, -1.0);
                 }
                 const long n_alloc = zoo::allocations_counted();
                 zoo::count_allocations(false);
                 return n_alloc;
             },
             py::arg("tokens"), py::arg("positions"), py::arg("hidden"), py::arg("rows"), py::arg("targets"),
             py::arg("steps"))
        .def("zero_grads", &Executor::zero_grads)
        .def("set_packed_base", &Executor::set_packed_base, py::arg("on"), py::call_guard<py::gil_scoped_release>())
        .def("packed_base_bytes", &Executor::packed_base_bytes)
        .def("packed_base", &Executor::packed_base)
        .def("set_checkpointing", &Executor::set_checkpointing)
        .def("set_precision", [](Executor& e, const std::string& p) { e.set_precision(zoo::precision_named(p)); })
        .def("precision", [](Executor& e) { return zoo::precision_name(e.precision()); })
        .def("set_clad_blocks", &Executor::set_clad_blocks)
        .def("clad_blocks", &Executor::clad_blocks)
        .def("checkpointing", &Executor::checkpointing)
        .def("set_checkpoint_layers", &Executor::set_checkpoint_layers)
        .def("checkpoint_layers", &Executor::checkpoint_layers)
        .def("grad_norm", &Executor::grad_norm)
        .def("grad_sum_squares", [](Executor& e, size_t begin, size_t end) {
            py::gil_scoped_release nogil;
            return e.grad_sum_squares(begin, end);
        }, py::arg("begin"), py::arg("end"))
        .def("grads_written_outside", &Executor::grads_written_outside)
        .def("set_decay_ranges", &Executor::set_decay_ranges)
        .def("adamw_step",
             [](Executor& e, float lr, float b1, float b2, float eps, float wd, float max_norm, double norm) {
                 py::gil_scoped_release nogil;
                 return e.adamw_step(lr, b1, b2, eps, wd, max_norm, norm);
             },
             py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
             py::arg("max_norm"), py::arg("norm") = -1.0)
        .def_readwrite("step_count", &Executor::step_count)
        .def("set_profiling", [](Executor& e, bool on) {
            e.profile = zoo::Profile{};
            e.profile.on = on;
        })
        .def("profile", [](Executor& e) {
            py::dict out;
#define ZOO_PROFILE_ENTRY(s) out[#s] = py::make_tuple(e.profile.forward[zoo::k_##s], e.profile.pullback[zoo::k_##s]);
            ZOO_PROFILE_SLOTS(ZOO_PROFILE_ENTRY)
#undef ZOO_PROFILE_ENTRY
            return out;
        })
        .def("decodes_fused", &Executor::decodes_fused, py::arg("rows"),
             "Whether a call of `rows` new rows (over all its segments) takes the fused decode step.")
        .def("reset_cache", [](Executor& e, int64_t batch, int64_t max_len) {
            const auto [B, T] = batch_shape(batch, max_len, "reset_cache");
            e.reset_cache(B, T);
        })
        .def("cache_floats", [](Executor& e, int64_t batch, int64_t max_len) {
            const auto [B, T] = batch_shape(batch, max_len, "cache_floats");
            return e.cache_floats(B, T);
        })
        .def("forward_cached", [](Executor& e, Tokens tokens, int pos0) {
            const auto [B, T] = check_tokens(tokens, "tokens");
            const float* out;
            {
                py::gil_scoped_release nogil;
                out = e.forward_cached(tokens.data(), B, T, pos0);
            }
            py::array_t<float> logits({B, e.dims().vocab_size});
            std::memcpy(logits.mutable_data(), out, sizeof(float) * B * e.dims().vocab_size);  // size_t first
            return logits;
        })
        .def("forward_segments", [](Executor& e, Tokens tokens, Tokens slots, Tokens starts, Tokens lengths) {
            if (tokens.ndim() != 1 || slots.ndim() != 1 || starts.ndim() != 1 || lengths.ndim() != 1)
                throw std::invalid_argument("zoo: forward_segments takes 1-D tokens, slots, starts and lengths");
            const py::ssize_t S = slots.shape(0);
            if (starts.shape(0) != S || lengths.shape(0) != S)
                throw std::invalid_argument("zoo: one slot, start and length per segment");
            int64_t total = 0;
            for (py::ssize_t s = 0; s < S; s++) total += std::max<int32_t>(0, lengths.data()[s]);
            if (total != tokens.shape(0))
                throw std::invalid_argument("zoo: the segments' lengths add up to " + std::to_string(total) + ", not " +
                                            std::to_string(tokens.shape(0)) + " tokens");
            const float* out;
            {
                py::gil_scoped_release nogil;
                out = e.forward_segments(tokens.data(), slots.data(), starts.data(), lengths.data(), (int)S);
            }
            py::array_t<float> logits({(int64_t)S, (int64_t)e.dims().vocab_size});
            std::memcpy(logits.mutable_data(), out, sizeof(float) * S * e.dims().vocab_size);
            return logits;
        }, py::arg("tokens"), py::arg("slots"), py::arg("starts"), py::arg("lengths"))
        .def("slot_length", &Executor::slot_length)
        .def("cache_slots", &Executor::cache_slots)
        .def("cache_length", &Executor::cache_length);
}
