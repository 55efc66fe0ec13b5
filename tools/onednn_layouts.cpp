// What prepacked weights would buy a frozen bf16 base (docs/benchmarks.md, "The base products
// against their kernels' rate"): each product of a LoRA step's linear layers and of its LM head,
// bf16 operands and an fp32 output as zoo runs them, timed on oneDNN's matmul with the weight
// matrix as zoo stores it (row-major: the forward reads it transposed, the input gradient as it
// is) and prepacked once in the layout oneDNN picks for that product (format_tag::any). Plain
// layouts make oneDNN pack the weights on every call; a prepacked base would need a second copy
// of every matrix, since the forward and the input gradient want different packings. An input
// gradient is also timed as zoo runs it: K in blocks of 2,048 rows (dy is rounded to bf16 a
// block at a time), each block's product adding into dx (native/kernels/gemm.cpp, matrix_xw).
//
//   tools/onednn_layouts.sh [ROWS D_MODEL QKV_OUT D_FF [VOCAB HEAD_ROWS] [JSON]]
//   default: llama-3.2-1b at 256 rows, its head in chunks of 128 rows
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
    double plain, zoo, packed;  // GFLOP/s, medians of 9 runs after 2; zoo: as zoo runs it
};

constexpr int kBlockRows = 2048;  // the K block of a bf16 matrix's input gradient (gemm.cpp, k_block_rows)

static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
static dnnl::stream stream(engine);

template <class Run>
static double median_seconds(Run&& run) {
    std::vector<double> t;
    for (int i = 0; i < 11; i++) {
        const auto t0 = std::chrono::steady_clock::now();
        run();
        if (i >= 2) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static double gflops(const dnnl::matmul& mm, dnnl::memory& a, dnnl::memory& b, dnnl::memory& c, double flop) {
    return flop / 1e9 / median_seconds([&] {
        mm.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
        stream.wait();
    });
}

// dx (M, N) = dy (M, K) W (K, N) as zoo runs it: K in blocks of kBlockRows rows of W, read in
// place; each block's columns of dy packed (M x n, as zoo rounds them into its scratch); the
// first block writes dx, the others add to it (a sum post-op).
static double blocked_gflops(int M, int N, int K, const uint16_t* dy_blocks, const uint16_t* W, float* dx) {
    struct Block { int r0, n; dnnl::matmul mm; dnnl::memory a, b, c; };
    std::vector<Block> blocks;
    for (int r0 = 0; r0 < K; r0 += kBlockRows) {
        const int n = std::min(kBlockRows, K - r0);
        const dnnl::memory::desc a({M, n}, dt::bf16, dims{n, 1}), b({n, N}, dt::bf16, dims{N, 1}),
            c({M, N}, dt::f32, dims{N, 1});
        dnnl::primitive_attr attr;
        if (r0) {
            dnnl::post_ops ops;
            ops.append_sum(1.0f);
            attr.set_post_ops(ops);
        }
        blocks.push_back({r0, n, dnnl::matmul(dnnl::matmul::primitive_desc(engine, a, b, c, attr)),
                          dnnl::memory(a, engine, const_cast<uint16_t*>(dy_blocks + (size_t)r0 * M)),
                          dnnl::memory(b, engine, const_cast<uint16_t*>(W + (size_t)r0 * N)),
                          dnnl::memory(c, engine, dx)});
    }
    return 2.0 * M * N * K / 1e9 / median_seconds([&] {
        for (Block& k : blocks) {
            k.mm.execute(stream, {{DNNL_ARG_SRC, k.a}, {DNNL_ARG_WEIGHTS, k.b}, {DNNL_ARG_DST, k.c}});
            stream.wait();
        }
    });
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
    Result r{layer, product, plain.impl_info_str(), packed.impl_info_str(), M, N, K, 0, 0, 0};
    r.plain = gflops(dnnl::matmul(plain), ma, mb, mc, flop);
    r.packed = gflops(dnnl::matmul(packed), ma, mp, mc, flop);
    // (A's values serve as the packed blocks of dy: the same count, and only the time is read)
    r.zoo = trans_b ? r.plain : blocked_gflops(M, N, K, A.data(), B.data(), C.data());
    return r;
}

static double ms(const Result& r, double gflops_rate) { return 2.0 * r.M * r.N * r.K / gflops_rate / 1e6; }

int main(int argc, char** argv) {
    if (argc != 1 && argc != 5 && argc != 6 && argc != 7 && argc != 8) {
        std::fprintf(stderr, "usage: onednn_layouts [ROWS D_MODEL QKV_OUT D_FF [VOCAB HEAD_ROWS] [JSON]]\n");
        return 2;
    }
    const bool shapes = argc > 1, head_given = argc > 6;
    const int rows = shapes ? std::atoi(argv[1]) : 256, d = shapes ? std::atoi(argv[2]) : 2048,
              qkv = shapes ? std::atoi(argv[3]) : 3072, ff = shapes ? std::atoi(argv[4]) : 8192,
              vocab = head_given ? std::atoi(argv[5]) : 128256, head_rows = head_given ? std::atoi(argv[6]) : 128;
    const char* json = argc == 6 ? argv[5] : argc == 8 ? argv[7] : nullptr;
    if (rows <= 0 || d <= 0 || qkv <= 0 || ff <= 0 || vocab <= 0 || head_rows <= 0) {
        std::fprintf(stderr, "onednn_layouts: ROWS, D_MODEL, QKV_OUT, D_FF, VOCAB and HEAD_ROWS must be positive\n");
        return 2;
    }
    const int chunk = std::min(head_rows, rows), chunks = (rows + chunk - 1) / chunk;
    struct Linear { const char* name; int in, out; };
    const Linear layers[] = {{"qkv", d, qkv}, {"attn_out", d, d}, {"mlp_in", d, 2 * ff}, {"mlp_out", ff, d}};
    measure("warm-up", "forward", rows, d, d, true);  // starts OpenMP's threads and oneDNN: not timed
    std::vector<Result> results;
    for (const Linear& l : layers) {
        results.push_back(measure(l.name, "forward", rows, l.out, l.in, true));  // y = x W^T
        results.push_back(measure(l.name, "dx", rows, l.in, l.out, false));      // dx = dy W
    }
    // The head's chunk of rows (its logits live a chunk at a time), once each way per chunk
    results.push_back(measure("lm_head", "forward", chunk, vocab, d, true));
    results.push_back(measure("lm_head", "dx", chunk, d, vocab, false));
    std::printf("| layer | product | M x N x K | as stored, whole | as zoo runs it | prepacked | prepacked / zoo's | kernel (as stored) |\n");
    std::printf("|---|---|---|---:|---:|---:|---:|---|\n");
    double layer_zoo = 0, layer_packed = 0, head_zoo = 0, head_packed = 0;
    for (const Result& r : results) {
        std::printf("| %s | %s | %d x %d x %d | %.0f | %.0f | %.0f | %.2f | %s |\n", r.layer.c_str(), r.product.c_str(),
                    r.M, r.N, r.K, r.plain, r.zoo, r.packed, r.packed / r.zoo, r.kernel_plain.c_str());
        const bool head = r.layer == "lm_head";
        (head ? head_zoo : layer_zoo) += ms(r, r.zoo) * (head ? chunks : 1);
        (head ? head_packed : layer_packed) += ms(r, r.packed) * (head ? chunks : 1);
    }
    const dnnl_version_t* v = dnnl_version();  // the kernels' names above say the ISA
    std::printf("\nGFLOP/s. A layer's products (each once): %.2f ms as zoo runs them, %.2f ms prepacked (%.2fx).\n"
                "The head's over %d rows (%d chunk%s of %d): %.2f ms as zoo runs them, %.2f ms prepacked (%.2fx). oneDNN %d.%d.%d\n",
                layer_zoo, layer_packed, layer_packed / layer_zoo, rows, chunks, chunks > 1 ? "s" : "", chunk, head_zoo,
                head_packed, head_packed / head_zoo, v->major, v->minor, v->patch);
    if (json) {
        const std::string path = json, tmp = path + ".tmp";
        FILE* f = std::fopen(tmp.c_str(), "w");
        if (!f) {
            std::fprintf(stderr, "onednn_layouts: cannot write %s\n", tmp.c_str());
            return 1;
        }
        std::fprintf(f,
                     "{\"onednn\": \"%d.%d.%d\", \"rows\": %d, \"d_model\": %d, \"qkv_out\": %d, \"d_ff\": %d, "
                     "\"vocab\": %d, \"head_rows\": %d, \"k_block_rows\": %d, \"products\": [",
                     v->major, v->minor, v->patch, rows, d, qkv, ff, vocab, chunk, kBlockRows);
        for (size_t i = 0; i < results.size(); i++) {
            const Result& r = results[i];
            std::fprintf(f,
                         "%s\n  {\"layer\": \"%s\", \"product\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, "
                         "\"plain_gflops\": %.1f, \"zoo_gflops\": %.1f, \"prepacked_gflops\": %.1f, "
                         "\"kernel_plain\": \"%s\", \"kernel_prepacked\": \"%s\"}",
                         i ? "," : "", r.layer.c_str(), r.product.c_str(), r.M, r.N, r.K, r.plain, r.zoo, r.packed,
                         r.kernel_plain.c_str(), r.kernel_packed.c_str());
        }
        std::fprintf(f,
                     "\n], \"layer_ms_zoo\": %.3f, \"layer_ms_prepacked\": %.3f, \"head_ms_zoo\": %.3f, "
                     "\"head_ms_prepacked\": %.3f}\n",
                     layer_zoo, layer_packed, head_zoo, head_packed);
        // written whole, then renamed over the old file: an interrupted run leaves the old one
        if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
            std::fprintf(stderr, "onednn_layouts: cannot write %s\n", path.c_str());
            return 1;
        }
    }
    return 0;
}
