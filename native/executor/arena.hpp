// One aligned float allocation carved into tensors by offsets computed up front.
// The executor owns: the parameter arena (weights and gradients; fixed for the model's
// lifetime, so views handed to Python never move), the AdamW moments' arena (mapped at their
// first use, sized to the range they cover), the activation arena (planned for a batch shape
// before a step; re-planned only when a larger shape arrives) and the KV cache's.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

// A byte range of a file, mapped private and writable: pages become resident only when read
// (a frozen embedding whose step reads a few hundred of its rows costs those rows), and a write
// makes a private copy of its page, never reaching the file. The file must keep its length while
// mapped (a file cut short under a mapping faults on its next read); zoo's own writers replace a
// checkpoint by renaming a new file over it, which leaves this mapping on the old one.
struct FileMapping {
    uint8_t* data = nullptr;  // the range's first byte

    FileMapping() = default;
    FileMapping(const FileMapping&) = delete;
    FileMapping& operator=(const FileMapping&) = delete;
    ~FileMapping() { release(); }

    // what names the range in errors (the tensor); they name the file too.
    void map(const std::string& path, size_t offset, size_t bytes, const std::string& what) {
        release();
        const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw std::invalid_argument("zoo: " + path + ": cannot open to map " + what);
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            throw std::invalid_argument("zoo: " + path + ": not a regular file; cannot map " + what);
        }
        if (offset > (size_t)st.st_size || bytes > (size_t)st.st_size - offset) {
            close(fd);
            throw std::invalid_argument("zoo: " + path + ": " + what + " needs bytes [" + std::to_string(offset) + ", " +
                                        std::to_string(offset + bytes) + ") of the file, which has " +
                                        std::to_string((size_t)st.st_size) + " (truncated?)");
        }
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        const size_t start = offset / page * page;
        void* p = bytes ? mmap(nullptr, offset + bytes - start, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, (off_t)start)
                        : nullptr;
        // The file cache's copies of the range go (those no process maps): a file just written or
        // scanned is cached in large folios, and a read fault maps as much of its folio as it
        // can, so one row read would bring hundreds of kilobytes in. Read afresh, without
        // read-ahead (below), each fault brings its own page.
        if (p) posix_fadvise(fd, (off_t)start, (off_t)(offset + bytes - start), POSIX_FADV_DONTNEED);
        close(fd);  // the mapping keeps the file open
        if (p == MAP_FAILED) throw AllocationError("zoo: " + path + ": the system refused to map " + what);
        // A step reads scattered rows: no read-ahead around each (it would fill the page cache
        // with rows nobody reads).
        if (p) madvise(p, offset + bytes - start, MADV_RANDOM);
        addr_ = p;
        len_ = p ? offset + bytes - start : 0;
        data = p ? static_cast<uint8_t*>(p) + (offset - start) : nullptr;
    }

private:
    void* addr_ = nullptr;
    size_t len_ = 0;
    void release() {
        if (addr_) munmap(addr_, len_);
        addr_ = nullptr;
        len_ = 0;
        data = nullptr;
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
