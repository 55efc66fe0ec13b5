// The few BLAS calls zoo makes, row-major, float32: oneMKL (ZOO_BLAS_MKL, from the mkl
// wheel) or OpenBLAS from the scipy-openblas32 wheel (symbols prefixed scipy_). CMakeLists.txt
// chooses.
#pragma once

#ifdef ZOO_BLAS_MKL
#include <mkl_cblas.h>
#include <mkl_service.h>
#define ZOO_CBLAS(name) cblas_##name
#else
#include <cblas.h>
#define ZOO_CBLAS(name) scipy_cblas_##name
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

// MKL's GNU threading layer runs its GEMMs on libgomp's threads, zoo's own pool: this sets how
// many of them a GEMM takes. OpenBLAS keeps a pool of its own.
inline void set_threads(int n) {
#ifdef ZOO_BLAS_MKL
    mkl_set_num_threads(n);
#else
    scipy_openblas_set_num_threads(n);
#endif
}

}  // namespace zoo::blas
