// Activation buffers placed by liveness. Each buffer says in which phases of a training step it
// holds a value someone will read; two buffers live in a common phase never share memory, and
// buffers that are never live at once may. The planner places them first-fit in the order they
// are declared and then proves the result: check() compares every pair.
#pragma once
#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace zoo {

// The phases of a training step: the trunk's forward, the chunked LM head (forward and
// pullback), the layers' pullbacks. A value written in one phase and read in a later one is
// live in every phase between.
enum Phase : unsigned { kForward = 1, kHead = 2, kPullback = 4, kAllPhases = 7 };

struct PlannedBuffer {
    std::string name;
    size_t floats;
    unsigned live;  // Phase bits
    size_t offset;  // floats from the arena's start; npos until placed
    static constexpr size_t npos = ~(size_t)0;
    size_t end() const { return offset + floats; }
};

class LivenessPlanner {
public:
    // Declares a buffer; returns its index. Sizes are rounded up to 16 floats (64 bytes), so
    // every buffer starts on a cache line.
    size_t add(std::string name, size_t floats, unsigned live) {
        if (live == 0 || live > kAllPhases)
            throw std::invalid_argument("zoo: buffer " + name + " has no valid live phases");
        buffers_.push_back({std::move(name), (floats + 15) / 16 * 16, live, PlannedBuffer::npos});
        return buffers_.size() - 1;
    }

    // Places every buffer not placed yet: the lowest offset at which it overlaps no placed
    // buffer that is live in a common phase.
    void place() {
        for (auto& b : buffers_) {
            if (b.offset != PlannedBuffer::npos) continue;
            size_t at = 0;
            for (bool moved = true; moved;) {
                moved = false;
                for (const auto& o : buffers_)
                    if (o.offset != PlannedBuffer::npos && (o.live & b.live) && at < o.end() &&
                        o.offset < at + b.floats) {
                        at = o.end();
                        moved = true;
                    }
            }
            b.offset = at;
        }
    }

    // Floats from the start to the end of the last placed buffer live in any of phases.
    size_t end_of(unsigned phases) const {
        size_t end = 0;
        for (const auto& b : buffers_)
            if (b.offset != PlannedBuffer::npos && (b.live & phases)) end = std::max(end, b.end());
        return end;
    }
    size_t total() const { return end_of(kAllPhases); }

    // Throws, naming both, if two buffers live in a common phase overlap (or one is unplaced).
    void check() const { check_buffers(buffers_); }
    static void check_buffers(const std::vector<PlannedBuffer>& buffers) {
        for (size_t i = 0; i < buffers.size(); i++) {
            const auto& a = buffers[i];
            if (a.offset == PlannedBuffer::npos) throw std::logic_error("zoo: buffer " + a.name + " was not placed");
            for (size_t j = i + 1; j < buffers.size(); j++) {
                const auto& b = buffers[j];
                if ((a.live & b.live) && a.floats && b.floats && a.offset < b.end() && b.offset < a.end())
                    throw std::logic_error("zoo: activation plan overlaps buffers " + a.name + " and " + b.name +
                                           ", which are live at the same time");
            }
        }
    }

    const PlannedBuffer& operator[](size_t i) const { return buffers_[i]; }
    const std::vector<PlannedBuffer>& buffers() const { return buffers_; }

private:
    std::vector<PlannedBuffer> buffers_;
};

}  // namespace zoo
