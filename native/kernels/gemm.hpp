// The matrix products, row-major, float32 in and out: every GEMM of every block goes through
// gemm() here. fp32 products run on one of the libraries built in (OpenBLAS from the
// scipy-openblas32 wheel always; oneMKL and oneDNN where their wheels were installed at build
// time), chosen once per process (set_fp32_library; the default is the measured fastest for
// the CPU, docs/benchmarks.md). bf16 products (mixed precision: operands rounded to bf16,
// products accumulated in fp32) run on oneDNN, on CPUs with bf16 dot products only.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/quant.hpp"

namespace zoo {

enum class Precision : int { fp32 = 0, bf16 = 1 };
inline const char* precision_name(Precision p) { return p == Precision::bf16 ? "bf16" : "fp32"; }
Precision precision_named(const std::string& name);  // throws on an unknown name

namespace gemm {

enum class Library : int { openblas, mkl, onednn };

// C[M,N] = op(A) op(B) + beta C, beta 0 or 1. trans_a/trans_b say whether A is stored (K,M)
// and B stored (N,K).
void gemm(Precision p, bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
          int ldb, float beta, float* C, int ldc);

// The same with A and B in bf16 already (rounded by the caller, round_to_bf16: a caller that
// reads one operand in several products rounds it once): a bf16 product on oneDNN.
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B,
               int ldb, float beta, float* C, int ldc);
// rows x cols of a (rows lda apart) rounded to bf16 (nearest even, as a bf16 product of fp32
// operands rounds them), packed rows x cols.
void round_to_bf16(const float* a, int lda, int rows, int cols, uint16_t* out);

// Products with a matrix W stored in a weight format (quant.hpp), W.rows x W.cols:
//   matrix_xwt: y (M, W.rows) = x (M, W.cols) W^T + beta y   (a linear layer's forward)
//   matrix_xw:  dx (M, W.cols) = dy (M, W.rows) W + beta dx  (its input's adjoint)
// fp32 storage is one gemm(). Otherwise, in a bf16 product, the left operand is rounded to bf16
// into scratch and the product reads stored bf16 values in place, or tiles of rows widened to
// bf16; in an fp32 product, tiles of rows widened to fp32. scratch: matrix_scratch_floats.
size_t matrix_scratch_floats(Precision p, DType t, int M, int rows, int cols);
void matrix_xwt(Precision p, int M, const float* x, int ldx, const Matrix& W, float beta, float* y, int ldy,
                float* scratch);
// The same in a bf16 product with a narrow W where the caller has rounded x into the start of
// scratch already (M x W.cols bf16 values, packed): for x read by another product too.
void matrix_xwt_rounded(int M, const Matrix& W, float beta, float* y, int ldy, float* scratch);
void matrix_xw(Precision p, int M, const float* dy, int lddy, const Matrix& W, float beta, float* dx, int lddx,
               float* scratch);
// A bf16 W's blocks of rows, as matrix_xw's bf16 products read them, reordered once into the
// blocked layout oneDNN's bf16 kernels take B in (Matrix::packed_xw): then no product packs W
// again, and the input gradients run at the kernels' rate, for a second copy of W in memory.
// packed_xw_bytes: 0 where W or this CPU has no such layout (not bf16, no oneDNN bf16 kernel).
size_t packed_xw_bytes(const Matrix& W);
void pack_xw(const Matrix& W, void* out);  // out: packed_xw_bytes(W), 64-byte aligned

// What would run op(A) op(B) of this shape, densely stored: the library, and for oneDNN its
// kernel (e.g. "onednn:brg:avx512_core_amx"; "... (operands rounded by zoo)" where zoo hands
// oneDNN bf16 operands it rounded, below). bf16_operands: A and B already in bf16 (a stored bf16
// matrix's products). For tests and reports.
std::string kernel(Precision p, bool trans_a, bool trans_b, int M, int N, int K, bool bf16_operands = false);
// Whether a kernel name (as kernel() gives it) runs on bf16 dot-product instructions.
bool is_bf16_kernel(const std::string& kernel);
// The oneDNN products this process ran since the last reset, each shape with the kernel it ran
// on and how many calls: what a run's products actually used (fp32 products on OpenBLAS or
// oneMKL are not listed: their library is the kernel).
struct KernelUse {
    Precision precision;
    bool trans_a, trans_b;
    int M, N, K;
    bool bf16_operands;
    std::string kernel;
    long calls;
};
std::vector<KernelUse> kernels_used();
void reset_kernels_used();
// The oneDNN primitives kept (one per product shape and form) and how many the cache keeps at
// most, the older half dropped when it is full (for tests).
std::pair<size_t, size_t> primitive_cache_entries();
const char* name(Library lib);
std::vector<Library> built_in();          // the libraries this build links
Library fp32_library();                   // the one fp32 products run on now
void set_fp32_library(const std::string& name);  // "auto" restores the default
Library default_fp32_library();           // the measured fastest built in, for this CPU's vendor

// bf16: whether this build can run bf16 products at all, and whether this CPU (as oneDNN sees
// it: DNNL_MAX_CPU_ISA lowers it) has native bf16 dot products. require_precision throws a
// message naming what is missing when a precision cannot run well here.
bool bf16_built();
bool bf16_native();
std::string cpu_isa();     // oneDNN's name for the instruction set it uses ("" without oneDNN)
std::string cpu_vendor();  // from CPUID: GenuineIntel, AuthenticAMD, ...
std::string openblas_core();  // the kernels OpenBLAS picked for this CPU (OPENBLAS_CORETYPE forces them)
int openblas_threads();        // the threads an OpenBLAS product runs on now (set_threads)
void require_precision(Precision p);

void set_threads(int n);  // the threads a GEMM takes (OpenBLAS keeps a pool of its own)

}  // namespace gemm
}  // namespace zoo
