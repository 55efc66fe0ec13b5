// The few BLAS calls zoo makes, row-major, float32. Built against scipy-openblas32 (symbols
// prefixed scipy_) or any CBLAS when ZOO_BLAS_PLAIN is defined.
#pragma once
#include <cblas.h>

#ifdef ZOO_BLAS_PLAIN
#define ZOO_CBLAS(name) cblas_##name
#define ZOO_OPENBLAS(name) openblas_##name
#else
#define ZOO_CBLAS(name) scipy_cblas_##name
#define ZOO_OPENBLAS(name) scipy_openblas_##name
#endif

namespace zoo::blas {

// C[M,N] = alpha * op(A) op(B) + beta * C, row-major. trans_a/trans_b say whether A is
// stored (K,M) and B stored (N,K).
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
    ZOO_CBLAS(sgemm)(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                     trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
                     ldc);
}

inline void set_threads(int n) { ZOO_OPENBLAS(set_num_threads)(n); }

}  // namespace zoo::blas
