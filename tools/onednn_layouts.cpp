// What prepacked weights would buy a frozen bf16 base (docs/benchmarks.md, "The base products
// against their kernels' rate"): each product of a LoRA step's linear layers, bf16 operands and
// an fp32 output as zoo runs them, timed on oneDNN's matmul with the weight matrix as zoo stores
// it (row-major: the forward reads it transposed, the input gradient as it is) and prepacked
// once in the layout oneDNN picks for that product (format_tag::any). Plain layouts make oneDNN
// pack the weights on every call; a prepacked base would need a second copy of every matrix,
// since the forward and the input gradient want different packings.
//
//   tools/onednn_layouts.sh [ROWS D_MODEL QKV_OUT D_FF [JSON]]   default: llama-3.2-1b, 256 rows
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

struct Result {
    std::string layer, product, kernel_plain, kernel_packed;
    int M, N, K;
    double plain, packed;  // GFLOP/s, median of 9 calls after 2
};

static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
static dnnl::stream stream(engine);

static double gflops(const dnnl::matmul& mm, dnnl::memory& a, dnnl::memory& b, dnnl::memory& c, double flop) {
    std::vector<double> t;
    for (int i = 0; i < 11; i++) {
        const auto t0 = std::chrono::steady_clock::now();
        mm.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
        stream.wait();
        if (i >= 2) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return flop / t[t.size() / 2] / 1e9;
}

// C (M, N) = A (M, K) B (K, N); B's strides as stored (trans_b: W (N, K) read transposed).
static Result measure(const std::string& layer, const std::string& product, int M, int N, int K, bool trans_b) {
    const dnnl::memory::desc a({M, K}, dt::bf16, dims{K, 1}), c({M, N}, dt::f32, dims{N, 1});
    const dnnl::memory::desc b({K, N}, dt::bf16, trans_b ? dims{1, K} : dims{N, 1});
    const dnnl::memory::desc any({K, N}, dt::bf16, dnnl::memory::format_tag::any);
    std::vector<uint16_t> A((size_t)M * K), B((size_t)K * N);
    std::vector<float> C((size_t)M * N);
    for (size_t i = 0; i < A.size(); i++) A[i] = 0x3f80 + (uint16_t)(i % 64);  // 1.0 .. 1.5
    for (size_t i = 0; i < B.size(); i++) B[i] = 0xbf80 + (uint16_t)(i % 61);  // -1.0 .. -1.5
    dnnl::memory ma(a, engine, A.data()), mb(b, engine, B.data()), mc(c, engine, C.data());
    const double flop = 2.0 * M * N * K;
    const dnnl::matmul::primitive_desc plain(engine, a, b, c), packed(engine, a, any, c);
    dnnl::memory mp(packed.weights_desc(), engine);
    dnnl::reorder(mb, mp).execute(stream, mb, mp);
    stream.wait();
    Result r{layer, product, plain.impl_info_str(), packed.impl_info_str(), M, N, K, 0, 0};
    r.plain = gflops(dnnl::matmul(plain), ma, mb, mc, flop);
    r.packed = gflops(dnnl::matmul(packed), ma, mp, mc, flop);
    return r;
}

int main(int argc, char** argv) {
    if (argc != 1 && argc != 5 && argc != 6) {
        std::fprintf(stderr, "usage: onednn_layouts [ROWS D_MODEL QKV_OUT D_FF [JSON]]\n");
        return 2;
    }
    const int rows = argc > 1 ? std::atoi(argv[1]) : 256, d = argc > 1 ? std::atoi(argv[2]) : 2048,
              qkv = argc > 1 ? std::atoi(argv[3]) : 3072, ff = argc > 1 ? std::atoi(argv[4]) : 8192;
    if (rows <= 0 || d <= 0 || qkv <= 0 || ff <= 0) {
        std::fprintf(stderr, "onednn_layouts: ROWS, D_MODEL, QKV_OUT and D_FF must be positive\n");
        return 2;
    }
    struct Linear { const char* name; int in, out; };
    const Linear layers[] = {{"qkv", d, qkv}, {"attn_out", d, d}, {"mlp_in", d, 2 * ff}, {"mlp_out", ff, d}};
    measure("warm-up", "forward", rows, d, d, true);  // starts OpenMP's threads and oneDNN: not timed
    std::vector<Result> results;
    for (const Linear& l : layers) {
        results.push_back(measure(l.name, "forward", rows, l.out, l.in, true));  // y = x W^T
        results.push_back(measure(l.name, "dx", rows, l.in, l.out, false));      // dx = dy W
    }
    std::printf("| layer | product | M x N x K | plain GFLOP/s | prepacked GFLOP/s | prepacked / plain | kernel (plain) |\n");
    std::printf("|---|---|---|---:|---:|---:|---|\n");
    double t_plain = 0, t_packed = 0;
    for (const Result& r : results) {
        std::printf("| %s | %s | %d x %d x %d | %.0f | %.0f | %.2f | %s |\n", r.layer.c_str(), r.product.c_str(), r.M,
                    r.N, r.K, r.plain, r.packed, r.packed / r.plain, r.kernel_plain.c_str());
        const double flop = 2.0 * r.M * r.N * r.K;
        t_plain += flop / r.plain;
        t_packed += flop / r.packed;
    }
    const dnnl_version_t* v = dnnl_version();  // the kernels' names above say the ISA
    std::printf("\nA layer's products (each once): %.2f ms plain, %.2f ms prepacked (%.2fx); oneDNN %d.%d.%d\n",
                t_plain / 1e6, t_packed / 1e6, t_packed / t_plain, v->major, v->minor, v->patch);
    if (argc == 6) {
        const std::string path = argv[5], tmp = path + ".tmp";
        FILE* f = std::fopen(tmp.c_str(), "w");
        if (!f) {
            std::fprintf(stderr, "onednn_layouts: cannot write %s\n", tmp.c_str());
            return 1;
        }
        std::fprintf(f, "{\"onednn\": \"%d.%d.%d\", \"rows\": %d, \"d_model\": %d, \"qkv_out\": %d, \"d_ff\": %d, \"products\": [",
                     v->major, v->minor, v->patch, rows, d, qkv, ff);
        for (size_t i = 0; i < results.size(); i++) {
            const Result& r = results[i];
            std::fprintf(f,
                         "%s\n  {\"layer\": \"%s\", \"product\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, "
                         "\"plain_gflops\": %.1f, \"prepacked_gflops\": %.1f, \"kernel_plain\": \"%s\", "
                         "\"kernel_prepacked\": \"%s\"}",
                         i ? "," : "", r.layer.c_str(), r.product.c_str(), r.M, r.N, r.K, r.plain, r.packed,
                         r.kernel_plain.c_str(), r.kernel_packed.c_str());
        }
        std::fprintf(f, "\n], \"layer_ms_plain\": %.3f, \"layer_ms_prepacked\": %.3f}\n", t_plain / 1e6, t_packed / 1e6);
        // written whole, then renamed over the old file: an interrupted run leaves the old one
        if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
            std::fprintf(stderr, "onednn_layouts: cannot write %s\n", path.c_str());
            return 1;
        }
    }
    return 0;
}
