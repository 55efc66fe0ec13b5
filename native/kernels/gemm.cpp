#include "kernels/gemm.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "executor/alloc_count.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa.hpp"

#if defined(ZOO_X86)
#include <cpuid.h>
#endif
#include <omp.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include <cblas.h>  // scipy-openblas32: every symbol prefixed scipy_
#ifdef ZOO_GEMM_MKL
// oneMKL's two entry points, declared here: its cblas.h clashes with OpenBLAS's. CBLAS enums
// are ints with the same values in both.
extern "C" {
void cblas_sgemm(int layout, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc);
void MKL_Set_Num_Threads(int n);
}
#endif
#ifdef ZOO_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace zoo {

Precision precision_named(const std::string& name) {
    if (name == "fp32") return Precision::fp32;
    if (name == "bf16") return Precision::bf16;
    throw std::invalid_argument("zoo: precision '" + name + "' is unknown (fp32 or bf16)");
}

namespace gemm {

namespace {

Library chosen = Library::openblas;
bool chosen_set = false;

#ifdef ZOO_GEMM_ONEDNN
// One oneDNN matmul primitive per product shape, made on first use and kept: a step makes the
// same few products every time, so after the first step no call creates or allocates anything.
// Operands are bound to the cached memory objects and executed through the C API, whose
// argument list lives on the stack.
struct Key {
    int precision, trans_a, trans_b, M, N, K, lda, ldb, ldc, accumulate;
    int bf16_operands;  // A and B given as bf16 bits (products with a stored bf16 matrix)
    int packed_b;       // B given in the blocked layout packed_b_desc names (pack_xw)
    bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};
struct KeyHash {
    size_t operator()(const Key& k) const {
        size_t h = 1469598103934665603ull;
        const int* f = &k.precision;
        for (size_t i = 0; i < sizeof(Key) / sizeof(int); i++) h = (h ^ (size_t)(unsigned)f[i]) * 1099511628211ull;
        return h;
    }
};
struct Matmul {
    dnnl::matmul primitive;
    dnnl::memory a, b, c;
    std::string kernel;  // oneDNN's name for the implementation it picked
    // A bf16 product of fp32 operands that zoo rounds to bf16 itself (rounded_gemm, which runs
    // it in panels as products of bf16 operands): where oneDNN's fpmath_mode::bf16 picks no bf16
    // kernel. The primitive here, of the whole product, names the kernel until the panels have
    // run; then `panels` names theirs (oneDNN may pick another kernel for a panel: a block of
    // C's columns, strided, takes gemm:jit:bf16 where the whole product takes brgemm).
    bool rounds_operands = false;
    bool prepacked = false;  // B read in the layout pack_xw wrote
    std::string panels;  // the kernels the panels ran on, " + " between them
    long calls = 0;
    unsigned long last_use = 0;  // use_clock at its last call (or its making)
};

dnnl::engine& engine() {
    static dnnl::engine e(dnnl::engine::kind::cpu, 0);
    return e;
}

// The blocked layout oneDNN's bf16 matmul picks for B (K x N, bf16) when left to choose, or
// none (an empty desc) where it keeps B plain or has no bf16 matmul: what pack_xw writes and
// its products read. oneDNN picks it by K, N and the ISA, not by M (a product of other rows
// that takes no such B falls back to W as stored: onednn_gemm). Kept per shape: a step asks
// for it in every input gradient.
dnnl::memory::desc packed_b_desc(int K, int N) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    static std::mutex mutex;
    static std::map<std::pair<int, int>, dnnl::memory::desc> known;
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = known.find({K, N}); it != known.end()) return it->second;
    dnnl::memory::desc packed;
    const dnnl::memory::desc plain({K, N}, dt::bf16, tag::ab);
    try {
        constexpr int rows = 256;  // a step's, for the query only
        const dnnl::matmul::primitive_desc pd(engine(), dnnl::memory::desc({rows, K}, dt::bf16, tag::ab),
                                              dnnl::memory::desc({K, N}, dt::bf16, tag::any),
                                              dnnl::memory::desc({rows, N}, dt::f32, tag::ab));
        if (is_bf16_kernel(pd.impl_info_str()) && pd.weights_desc() != plain) packed = pd.weights_desc();
    } catch (const dnnl::error&) {  // no bf16 matmul on this ISA (AVX2)
    }
    return known.emplace(std::pair{K, N}, packed).first->second;
}

Matmul make_matmul(const Key& k) {
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    // A (M,K) and B (K,N) described by strides, so a transposed operand is read in place.
    auto describe = [&](dt in, int lda, int ldb) {
        return std::pair{dnnl::memory::desc({k.M, k.K}, in, k.trans_a ? dims{1, lda} : dims{lda, 1}),
                         dnnl::memory::desc({k.K, k.N}, in, k.trans_b ? dims{1, ldb} : dims{ldb, 1})};
    };
    const dnnl::memory::desc c({k.M, k.N}, dt::f32, dims{k.ldc, 1});
    dnnl::primitive_attr attr;
    if (k.accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
    }
    auto make = [&](const std::pair<dnnl::memory::desc, dnnl::memory::desc>& ab, const dnnl::primitive_attr& at) {
        const dnnl::matmul::primitive_desc pd(engine(), ab.first, ab.second, c, at);
        return Matmul{dnnl::matmul(pd), dnnl::memory(ab.first, engine(), nullptr),
                      dnnl::memory(ab.second, engine(), nullptr), dnnl::memory(c, engine(), nullptr),
                      pd.impl_info_str()};
    };
    if (k.packed_b) {  // none where no bf16 kernel of these rows reads that layout: W is read as stored
        try {
            Matmul m = make({dnnl::memory::desc({k.M, k.K}, dt::bf16, dims{k.lda, 1}), packed_b_desc(k.K, k.N)}, attr);
            m.prepacked = true;
            return is_bf16_kernel(m.kernel) ? std::move(m) : Matmul{};
        } catch (const dnnl::error&) {
            return Matmul{};
        }
    }
    if (k.bf16_operands || k.precision != (int)Precision::bf16) return make(describe(k.bf16_operands ? dt::bf16 : dt::f32, k.lda, k.ldb), attr);
    // bf16 of fp32 operands: oneDNN rounds both to bf16 (nearest even) and sums in fp32. On AMX
    // its fpmath_mode::bf16 takes the AMX kernels; on AVX512_BF16 without AMX (Zen 4, Zen 5),
    // oneDNN 3.2 runs the fp32 kernel instead, so there zoo rounds the operands itself and hands
    // oneDNN bf16 ones, which take its bf16 kernels.
    dnnl::primitive_attr fpmath = attr;
    fpmath.set_fpmath_mode(dnnl::fpmath_mode::bf16);
    Matmul m = make(describe(dt::f32, k.lda, k.ldb), fpmath);
    if (is_bf16_kernel(m.kernel)) return m;
    const int packed_a = k.trans_a ? k.M : k.K, packed_b = k.trans_b ? k.K : k.N;
    try {
        Matmul r = make(describe(dt::bf16, packed_a, packed_b), attr);
        if (!is_bf16_kernel(r.kernel)) return m;  // no bf16 kernel either way: keep oneDNN's own rounding
        r.rounds_operands = true;
        return r;
    } catch (const dnnl::error&) {  // no matmul of bf16 operands on this ISA at all (AVX2)
        return m;
    }
}

std::string kernel_name(const Matmul& m) {
    if (m.prepacked) return m.kernel + " (weights prepacked)";
    if (!m.rounds_operands) return m.kernel;
    return (m.panels.empty() ? m.kernel : m.panels) + " (operands rounded by zoo)";
}
std::string onednn_kernel(const Key& k) { return kernel_name(make_matmul(k)); }

// Every oneDNN product made in this process, with its primitive: what kernels_used() reports.
std::mutex cache_mutex;  // the cached memory objects are rebound on every call
std::unordered_map<Key, Matmul, KeyHash> cache;
unsigned long use_clock = 0;  // counts the calls, under cache_mutex

// A step uses a few dozen shapes; generation adds one per prompt length. Bounded, so a
// long-lived process that sees many lengths does not keep every primitive forever: when full,
// the half used longest ago goes. (Clearing it all, in the middle of a step, dropped that step's
// first products too, and the next step made them again.)
constexpr size_t cache_capacity = 512;
void evict_older_half() {
    std::vector<unsigned long> uses;
    uses.reserve(cache.size());
    for (const auto& [k, m] : cache) uses.push_back(m.last_use);
    std::nth_element(uses.begin(), uses.begin() + uses.size() / 2, uses.end());
    const unsigned long cut = uses[uses.size() / 2];
    for (auto i = cache.begin(); i != cache.end();) i = i->second.last_use < cut ? cache.erase(i) : std::next(i);
}

// rows x cols of a (leading dimension lda) rounded to bf16, packed.
void to_bf16_rows(const float* a, int lda, int rows, int cols, uint16_t* out) {
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 32768)
    for (int m = 0; m < rows; m++) to_bf16_row(a + (size_t)m * lda, out + (size_t)m * cols, cols);
}

void rounded_gemm(const Key& whole, bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
                  int ldb, float beta, float* C, int ldc);

// panel_of: the product zoo rounds that this call is a panel of (kernels_used() counts that
// product, not its panels, and names the kernels its panels ran on), or null. packed_b: B is in
// packed_b_desc's layout (bf16 operands, neither transposed); false is returned, nothing run,
// where no product of these rows takes it.
bool onednn_gemm(Precision p, bool ta, bool tb, int M, int N, int K, const void* A, int lda, const void* B,
                 int ldb, float beta, float* C, int ldc, bool bf16_operands = false, const Key* panel_of = nullptr,
                 bool packed_b = false) {
    static dnnl::stream stream(engine());
    const Key key{(int)p, ta, tb, M, N, K, lda, ldb, ldc, beta != 0.0f, bf16_operands, packed_b};
    {
        std::unique_lock<std::mutex> lock(cache_mutex);
        auto it = cache.find(key);
        if (it == cache.end()) {
            if (cache.size() >= cache_capacity) evict_older_half();
            // A weight gradient's product (op(A) transposed: dW = dy^T x) writes in the first
            // step and adds from the second on (GradLifecycle, model.hpp: AdamW leaves zeros to
            // add into). Its other form is made with it, so the second step makes no primitive.
            Key twin = key;
            twin.accumulate = !key.accumulate;
            if (ta && !cache.count(twin)) cache.emplace(twin, make_matmul(twin)).first->second.last_use = ++use_clock;
            it = cache.emplace(key, make_matmul(key)).first;
        }
        Matmul& m = it->second;
        m.last_use = ++use_clock;
        if (packed_b && !m.primitive.get(true)) return false;
        if (!panel_of) {
            m.calls++;
        } else if (auto whole = cache.find(*panel_of); whole != cache.end()) {
            std::string& panels = whole->second.panels;
            if (panels.find(m.kernel) == std::string::npos)  // once per kernel: the first step's
                panels += (panels.empty() ? "" : " + ") + m.kernel;
        }
        if (!m.rounds_operands) {
            dnnl_memory_set_data_handle(m.a.get(), const_cast<void*>(A));
            dnnl_memory_set_data_handle(m.b.get(), const_cast<void*>(B));
            dnnl_memory_set_data_handle(m.c.get(), C);
            const dnnl_exec_arg_t args[3] = {
                {DNNL_ARG_SRC, m.a.get()}, {DNNL_ARG_WEIGHTS, m.b.get()}, {DNNL_ARG_DST, m.c.get()}};
            {
                // oneDNN builds its argument map and execution context on the heap on every call,
                // whatever the caller passes: counted apart (alloc_count.hpp).
                const LibraryCall in_onednn;
                if (dnnl_primitive_execute(m.primitive.get(), stream.get(), 3, args) != dnnl_success)
                    throw std::runtime_error("zoo: oneDNN matmul failed");
                stream.wait();
            }
            return true;
        }
    }
    rounded_gemm(key, ta, tb, M, N, K, static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, beta, C,
                 ldc);
    return true;
}

// A bf16 product of fp32 operands that zoo rounds itself (where oneDNN's fpmath mode picks no
// bf16 kernel), in panels: each rounded right before the product reads it, while it is in
// cache, and each operand rounded once. The operand with fewer rows outside K (op(A)'s M rows,
// or op(B)'s N columns) is rounded over all of them in one panel, of a block of K that fills
// half the buffer; the other a block of its own at a time beside it. One buffer of
// rounded_budget values, allocated at the first such product: a whole LM head weight rounded at
// once (GPT-2's: 74 MiB) would cost more memory than the step's activations, and read back from
// memory, more time.
constexpr size_t rounded_budget = size_t(4) << 20;  // 8 MiB of bf16

void rounded_gemm(const Key& whole, bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
                  int ldb, float beta, float* C, int ldc) {
    static std::mutex mutex;  // one buffer for the process
    static std::vector<uint16_t> rounded;
    std::lock_guard<std::mutex> lock(mutex);
    if (rounded.empty()) rounded.resize(rounded_budget);
    // Blocks of at most `most` along n, evened out, a multiple of 16 where that still fits.
    auto block = [](int n, size_t most) {
        most = std::max<size_t>(1, std::min<size_t>(most, n));
        const size_t parts = (n + most - 1) / most, b = (n + parts - 1) / parts;
        return (int)(b % 16 && b / 16 * 16 + 16 <= most ? b / 16 * 16 + 16 : b);
    };
    // op(A) rows [m0, m0 + m) x K [k0, k0 + k), packed (m x k, or k x m when ta).
    auto round_a = [&](int m0, int m, int k0, int k, uint16_t* out) {
        if (ta) to_bf16_rows(A + (size_t)k0 * lda + m0, lda, k, m, out);
        else to_bf16_rows(A + (size_t)m0 * lda + k0, lda, m, k, out);
    };
    // op(B) K [k0, k0 + k) x columns [n0, n0 + n), packed (k x n, or n x k when tb).
    auto round_b = [&](int k0, int k, int n0, int n, uint16_t* out) {
        if (tb) to_bf16_rows(B + (size_t)n0 * ldb + k0, ldb, n, k, out);
        else to_bf16_rows(B + (size_t)k0 * ldb + n0, ldb, k, n, out);
    };
    auto product = [&](int m0, int m, int n0, int n, int k0, int k, const uint16_t* a, const uint16_t* b) {
        onednn_gemm(Precision::bf16, ta, tb, m, n, k, a, ta ? m : k, b, tb ? k : n, k0 ? 1.0f : beta,
                    C + (size_t)m0 * ldc + n0, ldc, true, &whole);
    };
    uint16_t* buf = rounded.data();
    if ((size_t)M * K + (size_t)K * N <= rounded_budget) {  // both whole
        round_a(0, M, 0, K, buf);
        round_b(0, K, 0, N, buf + (size_t)M * K);
        return product(0, M, 0, N, 0, K, buf, buf + (size_t)M * K);
    }
    const bool a_outer = M <= N;  // the operand rounded over all its rows outside K
    const int outer = a_outer ? M : N, inner = a_outer ? N : M;
    const size_t half = rounded_budget / 2;
    const int kb = block(K, std::max<size_t>(16, half / outer));         // outer x kb fills half the buffer
    const int ob = block(outer, std::max<size_t>(1, half / kb));         // all of outer, but past 131,072
    const int ib = block(inner, std::max<size_t>(1, (rounded_budget - (size_t)ob * kb) / kb));
    uint16_t *outer_panel = buf, *inner_panel = buf + (size_t)ob * kb;
    for (int k0 = 0; k0 < K; k0 += kb) {
        const int k = std::min(kb, K - k0);
        for (int o0 = 0; o0 < outer; o0 += ob) {
            const int o = std::min(ob, outer - o0);
            if (a_outer) round_a(o0, o, k0, k, outer_panel);
            else round_b(k0, k, o0, o, outer_panel);
            for (int i0 = 0; i0 < inner; i0 += ib) {
                const int i = std::min(ib, inner - i0);
                if (a_outer) {
                    round_b(k0, k, i0, i, inner_panel);
                    product(o0, o, i0, i, k0, k, outer_panel, inner_panel);
                } else {
                    round_a(i0, i, k0, k, inner_panel);
                    product(i0, i, o0, o, k0, k, inner_panel, outer_panel);
                }
            }
        }
    }
}
#endif

void check_beta(float beta) {
    if (beta != 0.0f && beta != 1.0f) throw std::invalid_argument("zoo: gemm takes beta 0 or 1");
}

}  // namespace

void gemm(Precision p, bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
          float beta, float* C, int ldc) {
    check_beta(beta);
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  // an empty sum: C = beta C
        if (beta == 0.0f)
            for (int m = 0; m < M; m++) std::memset(C + (size_t)m * ldc, 0, sizeof(float) * N);
        return;
    }
    if (p == Precision::bf16) {
#ifdef ZOO_GEMM_ONEDNN
        onednn_gemm(p, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        return;
#else
        require_precision(p);  // throws
#endif
    }
    switch (fp32_library()) {
#ifdef ZOO_GEMM_MKL
        case Library::mkl:
            cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                        A, lda, B, ldb, beta, C, ldc);
            return;
#endif
#ifdef ZOO_GEMM_ONEDNN
        case Library::onednn:
            onednn_gemm(p, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
            return;
#endif
        default:
            scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
                              1.0f, A, lda, B, ldb, beta, C, ldc);
    }
}

void round_to_bf16(const float* a, int lda, int rows, int cols, uint16_t* out) {
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 32768)
    for (int m = 0; m < rows; m++) to_bf16_row(a + (size_t)m * lda, out + (size_t)m * cols, cols);
}

void gemm_bf16(bool ta, bool tb, int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B, int ldb,
               float beta, float* C, int ldc) {
    check_beta(beta);
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (beta == 0.0f)
            for (int m = 0; m < M; m++) std::memset(C + (size_t)m * ldc, 0, sizeof(float) * N);
        return;
    }
#ifdef ZOO_GEMM_ONEDNN
    onednn_gemm(Precision::bf16, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, true);
#else
    require_precision(Precision::bf16);  // throws
#endif
}

// --- products with a stored matrix (quant.hpp) ---------------------------------------

namespace {

// Rows of W a forward widens at a time, at least 16: 2M values in an fp32 product (8 MiB; at 1M,
// a 2048 x 8192 down projection of a 256-token step took tiles of 128 rows, too narrow for
// OpenBLAS: 205 GFLOP/s, 231-237 at 256 rows; AVX2 class). 4M in a bf16 one (8 MiB, the
// pullback's blocks, so no more scratch): an int8 or nf4 base's forward products at llama-3.1-8b's
// shapes ran 12-15% faster than with tiles of 1M (720-760 GFLOP/s against 650-680, down
// projection 690-745 against 565-590; 2 threads, Zen 5).
int tile_rows(Precision p, const Matrix& W) {
    const int values = p == Precision::fp32 ? 1 << 21 : 1 << 22;
    return std::min(W.rows, std::max(16, values / std::max(1, W.cols) / 16 * 16));
}

// Whether the product runs on bf16 operands: a bf16 product with a stored matrix narrower than fp32.
bool bf16_operands(Precision p, const Matrix& W) { return p == Precision::bf16 && W.dtype != DType::f32; }

// Rows of W (the products' K) a pullback takes at a time: one product over all of a wide W (an
// LM head's 128K rows) runs slower than in blocks, and only the block's part of dy is rounded
// to bf16 at a time (scratch of M x block, not M x rows). Blocks read in place: 2048 rows;
// widened ones: about 4M values.
int k_block_rows(Precision p, const Matrix& W) {
    if (bf16_operands(p, W) && W.dtype == DType::bf16) return std::min(W.rows, 2048);
    return std::min(W.rows, std::max(tile_rows(p, W), (1 << 22) / std::max(1, W.cols) / 16 * 16));
}

size_t bf16_floats(size_t values) { return (values + 31) / 32 * 16; }  // bf16 values in floats, 64-byte rounded

// A bf16 product's scratch with a narrow W, in floats from its start: x, or a block of dy,
// rounded to bf16 (left); then, for a widened (int8, nf4) W, the widened tile or block; then the
// forward's product of one tile (M x tile_rows), before it goes to its columns of y.
struct Bf16Scratch {
    size_t tile, packed, total;
};
Bf16Scratch bf16_scratch(const Matrix& W, int M) {
    const Precision p = Precision::bf16;
    const size_t left = bf16_floats((size_t)M * std::max(W.cols, k_block_rows(p, W)));
    if (W.dtype == DType::bf16) return {left, left, left};
    const size_t tile = bf16_floats((size_t)std::max(tile_rows(p, W), k_block_rows(p, W)) * W.cols);
    return {left, left + tile, left + tile + (size_t)M * tile_rows(p, W)};
}

// Bytes of one block of rows (K x N) packed in packed_b_desc's layout, 64-byte rounded; 0 where
// it has none.
size_t packed_block_bytes(int K, int N) {
#ifdef ZOO_GEMM_ONEDNN
    const dnnl::memory::desc packed = packed_b_desc(K, N);
    return packed.is_zero() ? 0 : (packed.get_size() + 63) / 64 * 64;
#else
    (void)K, (void)N;
    return 0;
#endif
}

// --- fp32 products with a narrow W on OpenBLAS, by thread ---
// OpenBLAS's threads split one product and wait on each other inside it: over the widened tiles
// of a bf16 base (llama-3.2-1b LoRA, 2 threads, Zen 3) 6% of the step was their waiting
// (inner_thread) on top of widening each tile before the product. Instead each of zoo's threads
// takes its own rows of W (forward) or its own columns (input gradient), widens a chunk of
// them into scratch of its own, and runs a single-threaded sgemm on it: that step's linear
// layers and head took 10.7 s instead of 12.0 (docs/benchmarks.md). A chunk's rows do not
// depend on the thread count, so neither do the sums.

// Rows of W widened at a time: about 512K values, at least 128 rows (a 2048 x 8192 down
// projection in chunks of 32 rows ran slower than in tiles: x repacked for too few rows).
int xwt_chunk_rows(const Matrix& W) { return std::min(W.rows, std::max(128, (1 << 19) / std::max(1, W.cols) / 16 * 16)); }
// Rows of W (the products' K) of an input gradient's block: about 1M values over all columns.
int xw_chunk_rows(const Matrix& W) { return std::min(W.rows, std::max(128, (1 << 20) / std::max(1, W.cols) / 16 * 16)); }
// A thread's rows in a forward, and its columns in an input gradient (whole nf4 blocks, so that
// each range widens alone).
int thread_rows(int rows, int threads) { return ((rows + threads - 1) / threads + 15) / 16 * 16; }
int thread_cols(int cols, int threads) { return ((cols + threads - 1) / threads + nf4_block - 1) / nf4_block * nf4_block; }
// A thread's scratch with `threads` threads.
size_t own_floats(const Matrix& W, int threads) {
    return std::max((size_t)std::min(xwt_chunk_rows(W), thread_rows(W.rows, threads)) * W.cols,
                    (size_t)xw_chunk_rows(W) * std::min(W.cols, thread_cols(W.cols, threads)));
}
// Scratch for up to `threads` threads: fewer threads take more columns each, so the most any
// count up to it needs (a plan made for more threads then holds a run with fewer).
size_t by_thread_floats(const Matrix& W, int threads) {
    size_t most = 0;
    for (int t = 1; t <= threads; t++) most = std::max(most, t * own_floats(W, t));
    return most;
}
bool by_thread(Precision p) { return p == Precision::fp32 && fp32_library() == Library::openblas; }

// body(thread, threads, its scratch) on zoo's threads, OpenBLAS single-threaded meanwhile (its
// thread count restored after): a sgemm called with OpenBLAS's threads on would run them all.
// The count is process-wide: a model stepping on another Python thread meanwhile may run its
// products on one thread for the while (slower, not wrong; OpenBLAS takes concurrent calls).
template <class Body>
void on_own_threads(const Matrix& W, float* scratch, Body&& body) {
    const int blas_threads = scipy_openblas_get_num_threads();
    if (blas_threads > 1) scipy_openblas_set_num_threads(1);
#pragma omp parallel
    {
        const int threads = omp_get_num_threads();
        body(omp_get_thread_num(), threads, scratch + (size_t)omp_get_thread_num() * own_floats(W, threads));
    }
    if (blas_threads > 1) scipy_openblas_set_num_threads(blas_threads);
}

void xwt_by_thread(int M, const float* x, int ldx, const Matrix& W, float beta, float* y, int ldy, float* scratch) {
    const int chunk = xwt_chunk_rows(W);
    on_own_threads(W, scratch, [&](int t, int threads, float* mine) {
        const int per = thread_rows(W.rows, threads);
        const int lo = std::min(W.rows, t * per), hi = std::min(W.rows, lo + per);
        for (int r0 = lo; r0 < hi; r0 += chunk) {
            const int n = std::min(chunk, hi - r0);
            for (int r = r0; r < r0 + n; r++) widen_row_range(W, r, 0, W.cols, mine + (size_t)(r - r0) * W.cols);
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, n, W.cols, 1.0f, x, ldx, mine, W.cols, beta,
                              y + r0, ldy);
        }
    });
}

void xw_by_thread(int M, const float* dy, int lddy, const Matrix& W, float beta, float* dx, int lddx, float* scratch) {
    const int chunk = xw_chunk_rows(W);
    on_own_threads(W, scratch, [&](int t, int threads, float* mine) {
        const int per = thread_cols(W.cols, threads);
        const int lo = std::min(W.cols, t * per), hi = std::min(W.cols, lo + per), width = hi - lo;
        for (int r0 = 0; width > 0 && r0 < W.rows; r0 += chunk) {
            const int n = std::min(chunk, W.rows - r0);
            for (int r = r0; r < r0 + n; r++) widen_row_range(W, r, lo, hi, mine + (size_t)(r - r0) * width);
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, width, n, 1.0f, dy + r0, lddy, mine, width,
                              r0 ? 1.0f : beta, dx + lo, lddx);
        }
    });
}
}  // namespace

size_t matrix_scratch_floats(Precision p, DType t, int M, int rows, int cols) {
    if (t == DType::f32) return 0;
    const Matrix W(nullptr, t, rows, cols);
    if (p == Precision::bf16) return bf16_scratch(W, M).total;
    // A tile widened to fp32 for another fp32 library, or OpenBLAS's chunks by thread: room for
    // both, as the library may be chosen after the plan.
    return std::max((size_t)std::max(tile_rows(p, W), k_block_rows(p, W)) * cols,
                    by_thread_floats(W, omp_get_max_threads()));
}

namespace {
// x rounded into the start of scratch (xb) times W^T: matrix_xwt's bf16 product.
void rounded_xwt(int M, const Matrix& W, float beta, float* y, int ldy, float* scratch) {
#ifdef ZOO_GEMM_ONEDNN
    const Precision p = Precision::bf16;
    const int R = tile_rows(p, W);
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(scratch);
    if (W.dtype == DType::bf16) {
        onednn_gemm(p, false, true, M, W.rows, W.cols, xb, W.cols, W.data, W.cols, beta, y, ldy, true);
        return;
    }
    const Bf16Scratch at = bf16_scratch(W, M);
    uint16_t* tile = reinterpret_cast<uint16_t*>(scratch + at.tile);
    float* packed = scratch + at.packed;  // M x R
    for (int r0 = 0; r0 < W.rows; r0 += R) {
        const int n = std::min(R, W.rows - r0);
        widen_rows_bf16(W, r0, r0 + n, tile);
        if (ldy == n) {  // one tile, y packed
            onednn_gemm(p, false, true, M, n, W.cols, xb, W.cols, tile, W.cols, beta, y, ldy, true);
            continue;
        }
        // A tile's columns of y are strided, and oneDNN 3.2 runs a product into strided columns on
        // gemm:jit:bf16, into packed ones on brgemm: at llama-3.1-8b's shapes (256 rows, 2
        // threads, Zen 5) an nf4 base's tiles ran 600-750 GFLOP/s into y, 780-880 into a packed
        // block copied into y.
        onednn_gemm(p, false, true, M, n, W.cols, xb, W.cols, tile, W.cols, 0.0f, packed, n, true);
        float* yr = y + r0;
#pragma omp parallel for schedule(static) if ((size_t)M * n > 32768)
        for (int m = 0; m < M; m++) {
            float* __restrict out = yr + (size_t)m * ldy;
            const float* __restrict in = packed + (size_t)m * n;
            if (beta == 0.0f) std::memcpy(out, in, sizeof(float) * n);
            else
                for (int j = 0; j < n; j++) out[j] += in[j];
        }
    }
#else
    require_precision(Precision::bf16);  // throws
#endif
}
}  // namespace

void matrix_xwt_rounded(int M, const Matrix& W, float beta, float* y, int ldy, float* scratch) {
    check_beta(beta);
    if (!bf16_operands(Precision::bf16, W))
        throw std::logic_error("zoo: matrix_xwt_rounded takes a narrow stored matrix (bf16, int8, nf4)");
    if (M > 0) rounded_xwt(M, W, beta, y, ldy, scratch);
}

void matrix_xwt(Precision p, int M, const float* x, int ldx, const Matrix& W, float beta, float* y, int ldy,
                float* scratch) {
    check_beta(beta);
    if (W.dtype == DType::f32) return gemm(p, false, true, M, W.rows, W.cols, x, ldx, W.f32(), W.cols, beta, y, ldy);
    if (M <= 0) return;
    const int R = tile_rows(p, W);
#ifdef ZOO_GEMM_ONEDNN
    if (bf16_operands(p, W)) {
        uint16_t* xb = reinterpret_cast<uint16_t*>(scratch);
        to_bf16_rows(x, ldx, M, W.cols, xb);
        return rounded_xwt(M, W, beta, y, ldy, scratch);
    }
#endif
    if (by_thread(p)) return xwt_by_thread(M, x, ldx, W, beta, y, ldy, scratch);
    for (int r0 = 0; r0 < W.rows; r0 += R) {
        const int n = std::min(R, W.rows - r0);
        widen_rows(W, r0, r0 + n, scratch);
        gemm(p, false, true, M, n, W.cols, x, ldx, scratch, W.cols, beta, y + r0, ldy);
    }
}

void matrix_xw(Precision p, int M, const float* dy, int lddy, const Matrix& W, float beta, float* dx, int lddx,
               float* scratch) {
    check_beta(beta);
    if (W.dtype == DType::f32) return gemm(p, false, false, M, W.cols, W.rows, dy, lddy, W.f32(), W.cols, beta, dx, lddx);
    if (M <= 0) return;
    const int R = k_block_rows(p, W);
#ifdef ZOO_GEMM_ONEDNN
    if (bf16_operands(p, W)) {
        uint16_t* db = reinterpret_cast<uint16_t*>(scratch);
        uint16_t* tile = reinterpret_cast<uint16_t*>(scratch + bf16_scratch(W, M).tile);
        const bool packed = W.packed_xw && W.dtype == DType::bf16;
        const size_t packed_block = packed ? packed_block_bytes(R, W.cols) : 0;  // all blocks but the last
        for (int r0 = 0; r0 < W.rows; r0 += R) {
            const int n = std::min(R, W.rows - r0);
            const float b = r0 ? 1.0f : beta;
            to_bf16_rows(dy + r0, lddy, M, n, db);
            if (packed && onednn_gemm(p, false, false, M, W.cols, n, db, n,
                                      static_cast<const uint8_t*>(W.packed_xw) + r0 / R * packed_block, W.cols, b,
                                      dx, lddx, true, nullptr, true))
                continue;
            const void* w = static_cast<const uint16_t*>(W.data) + (size_t)r0 * W.cols;
            if (W.dtype != DType::bf16) {
                widen_rows_bf16(W, r0, r0 + n, tile);
                w = tile;
            }
            onednn_gemm(p, false, false, M, W.cols, n, db, n, w, W.cols, b, dx, lddx, true);
        }
        return;
    }
#endif
    if (by_thread(p)) return xw_by_thread(M, dy, lddy, W, beta, dx, lddx, scratch);
    for (int r0 = 0; r0 < W.rows; r0 += R) {
        const int n = std::min(R, W.rows - r0);
        widen_rows(W, r0, r0 + n, scratch);
        gemm(p, false, false, M, W.cols, n, dy + r0, lddy, scratch, W.cols, r0 ? 1.0f : beta, dx, lddx);
    }
}

size_t packed_xw_bytes(const Matrix& W) {
#ifdef ZOO_GEMM_ONEDNN
    if (W.dtype != DType::bf16 || !bf16_native()) return 0;
    const int R = k_block_rows(Precision::bf16, W);
    size_t total = 0;
    for (int r0 = 0; r0 < W.rows; r0 += R) {
        const size_t block = packed_block_bytes(std::min(R, W.rows - r0), W.cols);
        if (!block) return 0;
        total += block;
    }
    return total;
#else
    (void)W;
    return 0;
#endif
}

void pack_xw(const Matrix& W, void* out) {
    if (!packed_xw_bytes(W)) throw std::logic_error("zoo: pack_xw: this matrix has no packed layout here");
#ifdef ZOO_GEMM_ONEDNN
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const int R = k_block_rows(Precision::bf16, W);
    dnnl::stream own(engine());  // not the products' stream: another model may run them meanwhile
    uint8_t* at = static_cast<uint8_t*>(out);
    for (int r0 = 0; r0 < W.rows; r0 += R) {
        const int n = std::min(R, W.rows - r0);
        auto* rows = const_cast<uint16_t*>(static_cast<const uint16_t*>(W.data) + (size_t)r0 * W.cols);
        dnnl::memory from({{n, W.cols}, dt::bf16, tag::ab}, engine(), rows), to(packed_b_desc(n, W.cols), engine(), at);
        dnnl::reorder(from, to).execute(own, from, to);  // zeroes the layout's padding too
        own.wait();
        at += packed_block_bytes(n, W.cols);
    }
#endif
}

std::string kernel(Precision p, bool ta, bool tb, int M, int N, int K, bool bf16_operands) {
    const bool dnnl = p == Precision::bf16 || fp32_library() == Library::onednn;
#ifdef ZOO_GEMM_ONEDNN
    if (dnnl)
        return std::string("onednn:") +
               onednn_kernel({(int)p, ta, tb, M, N, K, ta ? M : K, tb ? K : N, N, 0, bf16_operands && p == Precision::bf16});
#endif
    require_precision(p);
    (void)dnnl;
    (void)bf16_operands;
    return name(fp32_library());
}

// oneDNN's names say the ISA of its brgemm kernels (brg:avx512_core_bf16, brg:avx512_core_amx);
// its jit gemm ("gemm:jit:bf16") runs bf16 dot products only where the CPU has them, and
// emulates them (in fp32 instructions) elsewhere.
bool is_bf16_kernel(const std::string& kernel) {
    auto has = [&](const char* s) { return kernel.find(s) != std::string::npos; };
    return has("amx") || has("avx512_core_bf16") || has("vnni_2") || (has("bf16") && bf16_native());
}

std::vector<KernelUse> kernels_used() {
    std::vector<KernelUse> used;
#ifdef ZOO_GEMM_ONEDNN
    std::lock_guard<std::mutex> lock(cache_mutex);
    for (const auto& [k, m] : cache)
        if (m.calls)
            used.push_back({(Precision)k.precision, k.trans_a != 0, k.trans_b != 0, k.M, k.N, k.K, k.bf16_operands != 0,
                            "onednn:" + kernel_name(m), m.calls});
    std::sort(used.begin(), used.end(), [](const KernelUse& a, const KernelUse& b) {
        return std::tie(a.precision, a.M, a.N, a.K, a.trans_a, a.trans_b, a.bf16_operands) <
               std::tie(b.precision, b.M, b.N, b.K, b.trans_a, b.trans_b, b.bf16_operands);
    });
#endif
    return used;
}

std::pair<size_t, size_t> primitive_cache_entries() {
#ifdef ZOO_GEMM_ONEDNN
    std::lock_guard<std::mutex> lock(cache_mutex);
    return {cache.size(), cache_capacity};
#else
    return {0, 0};
#endif
}

void reset_kernels_used() {
#ifdef ZOO_GEMM_ONEDNN
    std::lock_guard<std::mutex> lock(cache_mutex);
    for (auto& [k, m] : cache) m.calls = 0;
#endif
}

const char* name(Library lib) {
    switch (lib) {
        case Library::mkl: return "mkl";
        case Library::onednn: return "onednn";
        default: return "openblas";
    }
}

std::vector<Library> built_in() {
    std::vector<Library> libs{Library::openblas};
#ifdef ZOO_GEMM_MKL
    libs.push_back(Library::mkl);
#endif
#ifdef ZOO_GEMM_ONEDNN
    libs.push_back(Library::onednn);
#endif
    return libs;
}

std::string cpu_vendor() {
#if defined(ZOO_X86)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return "unknown";
    char v[13];
    std::memcpy(v, &b, 4);
    std::memcpy(v + 4, &d, 4);
    std::memcpy(v + 8, &c, 4);
    v[12] = 0;
    return v;
#else
    return "unknown";  // no CPUID: zoo's choices for this CPU do not depend on its vendor
#endif
}

// Measured (docs/benchmarks.md, `python -m zoo.tools.bench_gemm`): on Intel Xeons oneMKL's
// sgemm runs GPT-2's products 0-10% faster than OpenBLAS; on AMD EPYC (Zen 4) it runs them
// 20-40% slower. oneDNN's fp32 matmul trailed both on each.
Library default_fp32_library() {
#ifdef ZOO_GEMM_MKL
    if (cpu_vendor() == "GenuineIntel") return Library::mkl;
#endif
    return Library::openblas;
}

Library fp32_library() {
    if (!chosen_set) {
        chosen = default_fp32_library();
        chosen_set = true;
    }
    return chosen;
}

void set_fp32_library(const std::string& lib) {
    if (lib == "auto") {
        chosen = default_fp32_library();
        chosen_set = true;
        return;
    }
    std::string have;
    for (Library l : built_in()) {
        if (lib == name(l)) {
            chosen = l;
            chosen_set = true;
            return;
        }
        have += std::string(have.empty() ? "" : ", ") + name(l);
    }
    const bool known = lib == "openblas" || lib == "mkl" || lib == "onednn";
    throw std::invalid_argument("zoo: GEMM library '" + lib + "' " +
                                (known ? "is not built into this zoo" : "is unknown") + " (built in: " + have +
                                "; auto picks for the CPU)" +
                                (lib == "mkl" ? ": install the mkl wheel (pip install mkl) and rebuild zoo" : "") +
                                (lib == "onednn" ? ": install onednn-devel-cpu-gomp and rebuild zoo" : ""));
}

std::string openblas_core() { return scipy_openblas_get_corename(); }
int openblas_threads() { return scipy_openblas_get_num_threads(); }

bool bf16_built() {
#ifdef ZOO_GEMM_ONEDNN
    return true;
#else
    return false;
#endif
}

std::string cpu_isa() {
#ifdef ZOO_GEMM_ONEDNN
    switch (dnnl_get_effective_cpu_isa()) {
        case dnnl_cpu_isa_sse41: return "sse41";
        case dnnl_cpu_isa_avx: return "avx";
        case dnnl_cpu_isa_avx2: return "avx2";
        case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
        case dnnl_cpu_isa_avx2_vnni_2: return "avx2_vnni_2";
        case dnnl_cpu_isa_avx512_core: return "avx512_core";
        case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
        case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
        case dnnl_cpu_isa_avx512_core_fp16: return "avx512_core_fp16";
        case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
        case dnnl_cpu_isa_avx512_core_amx_fp16: return "avx512_core_amx_fp16";
        default: return "other";
    }
#else
    return "";
#endif
}

bool bf16_native() {
#ifdef ZOO_GEMM_ONEDNN
    // The ISA values are bit sets: each one contains the sets below it.
    const unsigned isa = dnnl_get_effective_cpu_isa();
    auto has = [&](unsigned set) { return (isa & set) == set; };
    return has(dnnl_cpu_isa_avx512_core_bf16) || has(dnnl_cpu_isa_avx2_vnni_2);
#else
    return false;
#endif
}

}  // namespace gemm

VectorIsa onednn_vector_isa_cap() {
#ifdef ZOO_GEMM_ONEDNN
    const unsigned isa = dnnl_get_effective_cpu_isa();  // the CPU's, lowered by DNNL_MAX_CPU_ISA
    auto has = [&](unsigned set) { return (isa & set) == set; };
    if (has(dnnl_cpu_isa_avx512_core_bf16)) return VectorIsa::avx512_bf16;
    if (has(dnnl_cpu_isa_avx512_core)) return VectorIsa::avx512;
    if (has(dnnl_cpu_isa_avx2)) return VectorIsa::avx2;
    return VectorIsa::scalar;
#else
    // Without oneDNN, the same variable read as oneDNN reads it (its names, any case), so that
    // a forced class means the same in every build.
    const char* v = std::getenv("DNNL_MAX_CPU_ISA");
    std::string isa = v ? v : "";
    for (char& c : isa) c = (char)std::toupper((unsigned char)c);
    if (isa.empty() || isa == "ALL" || isa.rfind("AVX512_CORE_BF16", 0) == 0 || isa.rfind("AVX512_CORE_FP16", 0) == 0 ||
        isa.rfind("AVX512_CORE_AMX", 0) == 0)
        return VectorIsa::avx512_bf16;
    if (isa.rfind("AVX512_CORE", 0) == 0) return VectorIsa::avx512;
    if (isa.rfind("AVX2", 0) == 0) return VectorIsa::avx2;
    return VectorIsa::scalar;  // SSE41, AVX
#endif
}

namespace gemm {

void require_precision(Precision p) {
    if (p != Precision::bf16) return;
    if (!bf16_built())
        throw std::runtime_error(
            "zoo: precision bf16 needs oneDNN, which this zoo was built without (install the onednn-cpu-gomp and "
            "onednn-devel-cpu-gomp wheels, x86_64 only, and rebuild zoo); use precision fp32");
    if (!bf16_native())
        throw std::runtime_error(
            "zoo: precision bf16 needs a CPU with bf16 dot products (AVX512_BF16 or AMX-BF16, or AVX-NE-CONVERT), "
            "and this one has none (oneDNN's instruction set here: " + cpu_isa() +
            "): oneDNN would run the products in fp32 on slower kernels than zoo's fp32 library, so bf16 "
            "would gain nothing and lose speed (PyTorch users see the same: pytorch#86270). Use precision fp32");
}

void set_threads(int n) {
#ifdef ZOO_GEMM_MKL
    MKL_Set_Num_Threads(n);
#endif
    scipy_openblas_set_num_threads(n);
    (void)n;  // oneDNN (GNU OpenMP) runs on zoo's own OpenMP threads
}

}  // namespace gemm
}  // namespace zoo
