// Products of a few rows with a stored matrix: y (M, W.rows) = x (M, W.cols) W^T, M <= 8, the
// shape of generation (one new token per sequence). gemm.hpp's products widen W a tile at a time
// and hand it to a GEMM library, which for one row costs a second pass over the tile and the
// library's call; these read each stored value once, in its format (quant.hpp), turn it into a
// number in registers, and sum in fp32, on the widest instructions the build has: AVX-512 (with
// AVX512_BF16's dot products where built), AVX2, or plain C++. Memory bandwidth bounds them:
// every value of W is read once per call, whatever M.
//
// What is computed, the same on every instruction set (up to the order of the sums):
//   fp32 W:  sum over c of w x                  (in either precision: an fp32 product)
//   bf16 W:  sum of w x'
//   int8 W:  s_row * sum of q x'                 (q exact, the row's scale applied once)
//   nf4 W:   sum over blocks of s_block * sum of L'[q] x'
// where, in a bf16 product of a matrix stored narrower than fp32 (a bf16 product rounds its
// operands), x' = x rounded to bf16 and L' the NF4 levels rounded to bf16, except against int8
// W: there x' = s_x round(x / s_x), s_x = max|x| / 32767 over x's row, a 16-bit integer times
// its row's scale, so that the sums run on integer multiply-adds (|x' - x| <= max|x| / 65534:
// finer than bf16's |x| / 512 wherever |x| > max|x| / 128). In an fp32 product x' = x, L' = L.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/gemm.hpp"

namespace zoo {
namespace gemv {

constexpr int max_rows = 8;  // products of more rows go to gemm.hpp

// The instruction sets a product can run on. Which are built depends on the compiler's flags
// (-march); which run, on the CPU too (isas()).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };
const char* isa_name(Isa isa);
Isa isa_named(const std::string& name);  // throws on an unknown name
std::vector<Isa> isas();  // built into this zoo and supported by this CPU, scalar first
Isa best_isa();           // the last of isas()

// Scratch floats for a product of M rows of K columns: x as the kernels read it.
size_t scratch_floats(int M, int K);

// x (M rows, M in [1, max_rows]) as the kernels read it for matrices of W's format and width in
// this precision: made once, in scratch (scratch_floats(M, W.cols)), read by every row's sums.
struct Operand {
    Isa isa;
    DType dtype;
    int layout, M, K;
    size_t Kp;  // the row length of data, in its own units
    const void* data;
    float levels[16];            // NF4's levels as the product takes them
    uint16_t levels_bf16[16];
};
Operand prepare(Precision p, int M, const float* x, int ldx, const Matrix& W, float* scratch, Isa isa);

// Rows [r0, r1) of the product, on the calling thread: y[m][o] = residual[m][o] + bias[o] +
// (x W^T)[m][o] for o in [r0, r1); x prepared for W (or a matrix of its format and width). bias
// and residual may be null, residual may be y itself (each element is read, then written, by
// the one call that owns its row o). Throws nothing: it may run inside a parallel region.
void rows(const Operand& x, const Matrix& W, int r0, int r1, const float* bias, const float* residual, int ldr,
          float* y, int ldy);

// Threads take the rows of a product a chunk at a time as they finish the last (next: the first
// row nobody has taken), not a fixed share each: on a machine shared with other work, a thread
// the system sets aside holds up only the chunk it has, and the others take the rest. Each chunk
// is a share of what is left (guided scheduling): the first are long runs of W, which the
// hardware prefetchers stream at full speed, the last short. Whole cache lines of y.
template <class Work>
inline void take_rows(std::atomic<int>& next, int R, int threads, Work&& work) {
    int r0 = next.load(std::memory_order_relaxed);
    while (r0 < R) {
        const int c = std::max(16, ((R - r0) / (2 * threads) + 15) / 16 * 16), r1 = std::min(R, r0 + c);
        if (next.compare_exchange_weak(r0, r1, std::memory_order_relaxed)) {
            work(r0, r1);
            r0 = next.load(std::memory_order_relaxed);
        }
    }
}

// The whole product: prepare, then the rows in chunks over the OpenMP threads where W is large
// enough to pay for waking them (parallel false: the calling thread alone).
void product(Precision p, int M, const float* x, int ldx, const Matrix& W, const float* bias, const float* residual,
             int ldr, float* y, int ldy, float* scratch, Isa isa, bool parallel = true);
inline void product(Precision p, int M, const float* x, int ldx, const Matrix& W, const float* bias,
                    const float* residual, int ldr, float* y, int ldy, float* scratch) {
    product(p, M, x, ldx, W, bias, residual, ldr, y, ldy, scratch, best_isa());
}
// Whether a product with W is worth splitting over threads.
bool worth_threads(const Matrix& W);

}  // namespace gemv
}  // namespace zoo
