// Column sums over rows: the bias and norm weight gradients.
#pragma once
#include <cstddef>

#include <omp.h>

namespace zoo {

// A pass of its own over the rows (the bias gradients) runs with one contiguous column block
// per thread: each row read is a long contiguous run that the prefetcher follows, and the
// sums stay in L1. Narrow blocks (64 columns) strided every row by the row length and ran
// at about half the speed. Width of each thread's block for C columns: a multiple of 16.
inline int column_block(int C) {
    const int threads = omp_get_max_threads();
    const int width = (C + threads - 1) / threads;
    return (width + 15) / 16 * 16;
}

// A pass over the rows that computes more than the sums (the norm pullbacks) splits the rows
// and keeps one buffer of partial sums per thread; this adds them into dst in thread order,
// so the sums are the same whatever the schedule. Call inside a parallel region, after a
// barrier; the columns are split over the team.
inline void add_thread_parts(float* dst, const float* parts, size_t stride, int threads, int n) {
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
        float s = 0.0f;
        for (int t = 0; t < threads; t++) s += parts[t * stride + i];
        dst[i] += s;
    }
}

}  // namespace zoo
