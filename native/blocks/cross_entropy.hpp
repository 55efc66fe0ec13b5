// Softmax cross-entropy over the vocabulary, fused: the pullback turns the logits into their
// adjoint in place, so the probabilities are never stored. Targets equal to -100 are ignored;
// the loss is the mean over the others.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../fastmath.hpp"

namespace zoo {

// loss_out = logsumexp(logits) - logits[target].
inline void cross_entropy_forward_row(const float* logits, int target, float* loss_out, int V) {
    float mx = row_max(logits, V);
    float sum = 0.0f;
    for (int v = 0; v < V; v++) sum += fast_exp(logits[v] - mx);
    loss_out[0] = std::log(sum) + mx - logits[target];
}

struct CrossEntropy {
    int V;
    static constexpr int32_t ignore_index = -100;

    // Per-row losses into row_loss (0 for ignored rows); returns the mean and the number of
    // counted rows in *n_valid. Sums in a fixed order in double so the loss is reproducible.
    double forward(const float* logits, const int32_t* targets, float* row_loss, int N,
                   int* n_valid) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            if (targets[n] == ignore_index) {
                row_loss[n] = 0.0f;
                continue;
            }
            cross_entropy_forward_row(logits + (size_t)n * V, targets[n], row_loss + n, V);
        }
        double total = 0.0;
        int count = 0;
        for (int n = 0; n < N; n++)
            if (targets[n] != ignore_index) {
                total += row_loss[n];
                count++;
            }
        *n_valid = count;
        return count ? total / count : 0.0;
    }

    // logits -> dlogits in place: (softmax - onehot(target)) * grad_scale / n_valid. The
    // forward's row_loss gives logsumexp back (row_loss + logit[target]): one pass per row.
    void pullback(float* logits, const int32_t* targets, const float* row_loss, int N, int n_valid,
                  float grad_scale) const {
        const float k = n_valid ? grad_scale / n_valid : 0.0f;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float* l = logits + (size_t)n * V;
            if (targets[n] == ignore_index) {
                for (int v = 0; v < V; v++) l[v] = 0.0f;
                continue;
            }
            const float lse = row_loss[n] + l[targets[n]];
            for (int v = 0; v < V; v++) l[v] = k * fast_exp(l[v] - lse);
            l[targets[n]] -= k;
        }
    }
};

}  // namespace zoo
