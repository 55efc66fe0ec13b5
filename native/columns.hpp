// Column sums over rows (bias and norm weight gradients) run with one contiguous column
// block per thread: each row read is then a long contiguous run that the prefetcher
// follows and the partial sums stay in L1. Narrow blocks (64 columns) strided every row by
// the row length and ran these passes at a third of the memory bandwidth.
#pragma once
#include <omp.h>

namespace zoo {

// Width of each thread's column block for C columns: a multiple of 16 floats.
inline int column_block(int C) {
    const int threads = omp_get_max_threads();
    const int width = (C + threads - 1) / threads;
    return (width + 15) / 16 * 16;
}

}  // namespace zoo
