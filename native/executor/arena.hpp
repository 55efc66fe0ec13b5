// One aligned float allocation carved into tensors by offsets computed up front.
// The executor owns: the parameter arena (weights and gradients; fixed for the model's
// lifetime, so views handed to Python never move), the AdamW moments' arena (mapped at their
// first use, sized to the range they cover), the activation arena (planned for a batch shape
// before a step; re-planned only when a larger shape arrives) and the KV cache's.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace zoo {

// An arena the system would not map: Python sees a MemoryError (bindings.cpp), so the CLI
// reports it as a lack of memory, with the size and the arena named.
struct AllocationError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Arena {
    float* data = nullptr;
    size_t size = 0;  // floats

    Arena() = default;
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena() { release(); }

    // Anonymous pages: page-aligned, zero, and resident only once touched, so an arena
    // costs memory for what a step really uses.
    // what names the arena in the error (the parameter arena, the activation arena...).
    void reset(size_t n_floats, const char* what) {
        release();
        if (n_floats == 0) return;
        if (n_floats > SIZE_MAX / sizeof(float))
            throw AllocationError(std::string("zoo: cannot allocate ") + what + ": " + std::to_string(n_floats) +
                                  " floats do not fit in the address space");
        bytes_ = n_floats * sizeof(float);
        void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            bytes_ = 0;
            throw AllocationError(std::string("zoo: cannot allocate ") + std::to_string((n_floats * 4) >> 20) +
                                  " MiB for the " + what + " (the system refused the mapping)");
        }
        // Transparent huge pages where the kernel offers them on request (the common
        // "madvise" setting): a step streams over gigabytes of weights, gradients and moments,
        // and 4 KiB pages make that TLB-bound (AdamW over GPT-2: 73 -> 62 ms). Advice only.
        madvise(p, bytes_, MADV_HUGEPAGE);
        data = static_cast<float*>(p);
        size = n_floats;
    }

private:
    size_t bytes_ = 0;
    void release() {
        if (data) munmap(data, bytes_);
        data = nullptr;
        size = 0;
        bytes_ = 0;
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
