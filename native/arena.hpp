// One aligned float allocation carved into tensors by offsets computed up front.
// The executor owns two: the parameter arena (weights, gradients, AdamW moments; fixed for
// the model's lifetime, so views handed to Python never move) and the activation arena
// (planned for a batch shape before a step; re-planned only when a larger shape arrives).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace zoo {

struct Arena {
    float* data = nullptr;
    size_t size = 0;  // floats

    Arena() = default;
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena() { std::free(data); }

    void reset(size_t n_floats) {
        std::free(data);
        data = nullptr;
        size = 0;
        if (n_floats == 0) return;
        size_t bytes = ((n_floats * sizeof(float) + 63) / 64) * 64;
        data = static_cast<float*>(std::aligned_alloc(64, bytes));
        if (!data)
            throw std::runtime_error("zoo: cannot allocate " + std::to_string(bytes >> 20) +
                                     " MiB for the arena");
        std::memset(data, 0, bytes);
        size = n_floats;
    }
};

// Hands out 64-byte aligned offsets while a plan is being laid out.
struct ArenaPlanner {
    size_t used = 0;
    size_t take(size_t n_floats) {
        size_t at = used;
        used += (n_floats + 15) / 16 * 16;
        return at;
    }
};

}  // namespace zoo
