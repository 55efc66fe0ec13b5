// Softmax cross-entropy over the vocabulary, fused: the pullback turns the logits into their
// adjoint in place, so the probabilities are never stored. Targets equal to -100 are ignored;
// the loss is the mean over the others.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "blocks/block.hpp"
#include "clad/clad_backend.hpp"
#include "kernels/fastmath.hpp"

namespace zoo {

// loss_out = logsumexp(logits) - logits[target]. The row's logits become their exponentials
// (shifted by the row's maximum), in place: Clad's gradient reads them back (exp_into).
inline void cross_entropy_forward_row(float* logits, int target, float* loss_out, int V) {
    const float shift = softmax_shift(logits, V), target_logit = logits[target];
    float sum = 0.0f;
    for (int v = 0; v < V; v++) {
        exp_into(logits[v] - shift, &logits[v]);
        sum += logits[v];
    }
    loss_out[0] = std::log(sum) + shift - target_logit;
}

struct CrossEntropy {
    int V;
    static constexpr int32_t ignore_index = -100;

    // The mean of the counted rows' losses, their number in *n_counted. Sums in a fixed order
    // in double so the loss is reproducible.
    static double mean_loss(const int32_t* targets, const float* row_loss, int N, int* n_counted) {
        double total = 0.0;
        int count = 0;
        for (int n = 0; n < N; n++)
            if (targets[n] != ignore_index) {
                total += row_loss[n];
                count++;
            }
        *n_counted = count;
        return count ? total / count : 0.0;
    }

    // Per-row losses into row_loss (0 for ignored rows); returns the mean and the number of
    // counted rows in *n_valid. The counted rows' logits become their exponentials, in place.
    double forward(float* logits, const int32_t* targets, float* row_loss, int N, int* n_valid) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            if (targets[n] == ignore_index) {
                row_loss[n] = 0.0f;
                continue;
            }
            cross_entropy_forward_row(logits + (size_t)n * V, targets[n], row_loss + n, V);
        }
        return mean_loss(targets, row_loss, N, n_valid);
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

    // The adjoint of row n's loss: grad_scale / n_valid (the mean over counted rows), or
    // grad_scale * row_weight[n] where the caller gives each row its own (a preference
    // objective's dL/d(row loss): zoo/train/preference_loss.py).
    static float row_seed(const float* row_weight, int n, int n_valid, float grad_scale) {
        if (row_weight) return grad_scale * row_weight[n];
        return n_valid ? grad_scale / n_valid : 0.0f;
    }

    // Training's forward and pullback fused, logits -> dlogits in place with the per-row
    // losses: the exponentials summed for the loss are kept and scaled into the
    // probabilities, so each logit is exponentiated once instead of twice. Same results as
    // forward then pullback; returns the mean over the counted rows (*n_counted of them).
    // row_weight (N, may be null): see row_seed.
    double forward_pullback(float* logits, const int32_t* targets, float* row_loss, int N, int n_valid,
                            float grad_scale, int* n_counted, const float* row_weight = nullptr) const {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float* l = logits + (size_t)n * V;
            const int32_t t = targets[n];
            const float k = row_seed(row_weight, n, n_valid, grad_scale);
            if (t == ignore_index) {
                row_loss[n] = 0.0f;
                for (int v = 0; v < V; v++) l[v] = 0.0f;
                continue;
            }
            const float target_logit = l[t], mx = row_max(l, V);
            float sum = 0.0f;
            for (int v = 0; v < V; v++) {
                l[v] = fast_exp(l[v] - mx);
                sum += l[v];
            }
            row_loss[n] = std::log(sum) + mx - target_logit;
            const float c = k / sum;
            for (int v = 0; v < V; v++) l[v] *= c;
            l[t] -= k;
        }
        return mean_loss(targets, row_loss, N, n_counted);
    }

    // The Clad backend's training pass: Clad's gradient of cross_entropy_forward_row, rows in
    // parallel, logits -> dlogits in place with the per-row losses, like forward_pullback
    // (defined below, compiled only into a Clad build). The gradient's replay of the forward
    // writes each row's loss. Per thread, scratch holds the row's adjoint (the gradient reads
    // the row's exponentials, which the replay leaves where the logits were).
    size_t clad_scratch_floats(int threads) const { return (size_t)threads * (((size_t)V + 1 + 15) / 16 * 16); }
    double forward_pullback_clad(float* logits, const int32_t* targets, float* row_loss, int N, int n_valid,
                                 float grad_scale, int* n_counted, const float* row_weight, float* scratch) const;
};

// The registry entry (native/blocks/registry.hpp): a chunk of rows' losses and, in place, their
// logits' adjoint; returns the chunk's mean loss over its *n_counted counted rows. row_weight:
// each row's own adjoint (row_seed), or null for the mean.
using CrossEntropyPullback = double (*)(const CrossEntropy& ce, float* logits, const int32_t* targets,
                                        float* row_loss, int N, int n_valid, float grad_scale, int* n_counted,
                                        const float* row_weight, float* scratch);
double cross_entropy_pullback_clad(const CrossEntropy& ce, float* logits, const int32_t* targets, float* row_loss,
                                   int N, int n_valid, float grad_scale, int* n_counted, const float* row_weight,
                                   float* scratch);
inline const FixedBlock<CrossEntropyPullback> cross_entropy_block{
    "cross_entropy",
    [](const CrossEntropy& ce, float* logits, const int32_t* targets, float* row_loss, int N, int n_valid,
       float grad_scale, int* n_counted, const float* row_weight, float*) {
        return ce.forward_pullback(logits, targets, row_loss, N, n_valid, grad_scale, n_counted, row_weight);
    },
    ZOO_CLAD_FN(cross_entropy_pullback_clad),
    /*in_step=*/true,
};

}  // namespace zoo

#ifdef ZOO_CLAD_TU
double zoo::CrossEntropy::forward_pullback_clad(float* logits, const int32_t* targets, float* row_loss, int N,
                                                int n_valid, float grad_scale, int* n_counted, const float* row_weight,
                                                float* scratch) const {
#pragma omp parallel
    {
        auto grad = clad::gradient(cross_entropy_forward_row, "logits, loss_out");
        float* d = scratch + omp_get_thread_num() * clad_pad((size_t)V + 1);
        float* seed = d + V;
        for (int v = 0; v < V; v++) d[v] = 0.0f;  // the gradient adds into d; each row leaves it zero
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float* l = logits + (size_t)n * V;
            if (targets[n] == ignore_index) {
                row_loss[n] = 0.0f;
                for (int v = 0; v < V; v++) l[v] = 0.0f;
                continue;
            }
            seed[0] = row_seed(row_weight, n, n_valid, grad_scale);  // dL/d(row loss)
            grad.execute(l, targets[n], row_loss + n, V, d, seed);
            for (int v = 0; v < V; v++) {
                l[v] = d[v];
                d[v] = 0.0f;
            }
        }
    }
    return mean_loss(targets, row_loss, N, n_counted);
}

double zoo::cross_entropy_pullback_clad(const CrossEntropy& ce, float* logits, const int32_t* targets,
                                        float* row_loss, int N, int n_valid, float grad_scale, int* n_counted,
                                        const float* row_weight, float* scratch) {
    return ce.forward_pullback_clad(logits, targets, row_loss, N, n_valid, grad_scale, n_counted, row_weight,
                                    scratch);
}
#endif
