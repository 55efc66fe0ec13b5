// What a block registers (native/blocks/registry.hpp lists them): its name, its forward, its
// hand-written pullback, its Clad pullback where built, and the scratch and per-row statistics
// each needs. The executor picks each layer's functions from these entries when a model is built
// (and when its AD backend changes), so no call site branches on a block's kind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace zoo {

// Whether a pullback writes its parameter gradients or adds into them: an argument of every
// pullback with parameters, decided by the executor's gradient lifecycle (model.hpp).
enum class GradMode { write, add };

// Row n of a (B, T) batch: its position in its sequence. positions (B*T, may be null) gives it
// where a caller packs several examples into one row, each restarting at 0 (attention then keeps
// to the row's own example); null means pos0 + n % T.
inline int position_of(const int32_t* positions, int n, int T, int pos0 = 0) {
    return positions ? positions[n] : pos0 + n % T;
}

// The keys query row t of a sequence sees in training: first..t, except the hidden span
// [lo, hi) (empty when lo == hi). pos: the sequence's positions (may be null: every row sees
// keys 0..t); hidden: its (lo, hi) pairs, one per row (may be null: no row hides any). Without
// a hidden span a row sees its own packed example, first = t - position. With one (the second
// answer of a preference pair, which sees the shared prompt but not the first answer:
// zoo/train/preference.py) a row's position still counts the keys it sees before itself, so
// first = t - position - (hi - lo). Executor::check_masks keeps first..t inside the row.
struct VisibleKeys {
    int first, lo, hi;
};
inline VisibleKeys visible_keys(const int32_t* pos, const int32_t* hidden, int t) {
    if (!pos) return {0, 0, 0};
    const int first = t - pos[t];
    if (hidden && hidden[2 * t + 1] > hidden[2 * t]) {
        const int lo = hidden[2 * t], hi = hidden[2 * t + 1];
        return {first - (hi - lo), lo, hi};
    }
    return {first, first, first};
}

// The keys row t sees under an attention window of `window` keys (0: none): the last `window`
// of those vis leaves it (Mistral's sliding window, Gemma's local layers), itself included.
inline VisibleKeys windowed_keys(VisibleKeys vis, int t, int window) {
    const int before = vis.lo - vis.first, drop = before + (t + 1 - vis.hi) - window;
    if (window <= 0 || drop <= 0) return vis;
    if (drop <= before) return {vis.first + drop, vis.lo, vis.hi};
    const int first = vis.hi + (drop - before);
    return {first, first, first};
}

// Throws std::invalid_argument, naming the row and column at fault, where positions (B*T) and
// hidden spans (B*T pairs; may be null) would send a row's keys outside its row: without a
// hidden span a position is 0 (an example begins) or the one before it plus one (a row begins
// with 0); with one, lo < hi <= t and lo >= first >= 0 (visible_keys).
inline void check_visible_keys(const int32_t* positions, const int32_t* hidden, int B, int T) {
    if (!positions) {
        if (hidden) throw std::invalid_argument("zoo: hidden key spans need positions");
        return;
    }
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const size_t n = (size_t)b * T + t;
            const int32_t p = positions[n], prev = t ? positions[n - 1] : -1;
            const std::string at = "[" + std::to_string(b) + ", " + std::to_string(t) + "]";
            const int32_t lo = hidden ? hidden[2 * n] : 0, hi = hidden ? hidden[2 * n + 1] : 0;
            if (hidden && hi > lo) {
                const int64_t first = (int64_t)t - p - (hi - lo);
                if (lo < 0 || hi > t || first < 0 || first > lo)
                    throw std::invalid_argument("zoo: hidden" + at + " = [" + std::to_string(lo) + ", " +
                                                std::to_string(hi) + ") with position " + std::to_string(p) +
                                                ": a row hides keys before itself, within the keys its position "
                                                "reaches back to (first = t - position - hidden keys >= 0)");
                continue;
            }
            if (p != 0 && p != prev + 1)
                throw std::invalid_argument("zoo: positions" + at + " = " + std::to_string(p) + " after " +
                                            std::to_string(prev) +
                                            ": positions count up by one from 0, restarting at 0 where a packed "
                                            "example begins (a row begins with one)");
        }
}

// A function that exists only in a Clad build: registries name it through this macro, so a
// build without Clad compiles the entry with a null pointer and never references the symbol.
#ifdef ZOO_CLAD
#define ZOO_CLAD_FN(f) (f)
constexpr bool clad_built = true;
#else
#define ZOO_CLAD_FN(f) nullptr
constexpr bool clad_built = false;
#endif

// --- kinds chosen by the config: one entry per kind ---------------------------------------

// A normalization over rows of C: y = f(x) * w (+ b). The forward saves stats_per_row floats per
// row, laid out by statistic: stats[s * N + n].
struct NormArgs {
    int C;
    float eps;
    int N;
    const float* x;
    const float* w;
    const float* b;  // null when the norm has no bias
    float* stats;    // per-row statistics: the forward writes them, the hand-written pullback reads them
};
using NormForward = void (*)(const NormArgs& a, float* y);
// Adds into dx; writes or adds dw (and db) per mode. scratch: scratch_floats(C, threads).
// y, where not null: the pullback leaves the norm's output there too, recomputed (the layers
// share one buffer for it, and the next linear's weight gradient reads it). The hand-written
// pullbacks rerun the forward for it (writing the same stats); Clad's replay computes it anyway.
using NormPullback = void (*)(const NormArgs& a, const float* dy, float* y, float* dx, float* dw, float* db,
                              float* scratch, GradMode mode);
using ScratchFloats = size_t (*)(int C, int threads);

struct NormBlock {
    const char* name;
    bool bias;  // parameters: weight (C), and bias (C) when true
    int stats_per_row;
    NormForward forward;
    NormPullback pullback;       // hand-written; null when the block has none
    ScratchFloats scratch_floats;
    NormPullback pullback_clad;  // generated by Clad; null without the Clad backend
    ScratchFloats clad_scratch_floats;
};

// An MLP activation: rows of gate_width * F in, rows of F out (gate_width 2: a gated unit whose
// input rows are [gate | up] from one fused GEMM).
using ActivationForward = void (*)(int F, const float* x, float* y, int N);
// Writes dx.
using ActivationPullback = void (*)(int F, const float* x, const float* dy, float* dx, int N);
// The training pullback fused with the recompute of y (the projection's weight gradient reads
// y, which is not kept): one pass over x and dy.
using ActivationRecomputePullback = void (*)(int F, const float* x, const float* dy, float* y, float* dx, int N);

struct ActivationBlock {
    const char* name;
    int gate_width;
    ActivationForward forward;
    ActivationPullback pullback;  // hand-written; null when the block has none
    ActivationRecomputePullback recompute_and_pullback;  // hand-written; null when the block has none
    ActivationPullback pullback_clad;  // null without the Clad backend
    ActivationRecomputePullback recompute_and_pullback_clad;  // null without the Clad backend
};

// --- blocks every model has: their pullbacks, each with the block's own signature ----------
template <class Pullback>
struct FixedBlock {
    const char* name;
    Pullback pullback;       // hand-written
    Pullback pullback_clad;  // null without the Clad backend
    bool in_step;            // a training step runs it (the residual adds are fused into Linear)
};

}  // namespace zoo
