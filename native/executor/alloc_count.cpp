// A test instrument: counts the C++ heap allocations (operator new in every form: std::vector,
// std::string, Clad's tape slabs) this module makes while counting is on. A training step makes
// none: the arenas are mapped when a plan is made, and every pullback's scratch, Clad's included,
// lives in them (tests/test_no_allocation.py); oneDNN's per-call allocations inside its primitive
// execution are counted apart (LibraryCall). The replacements bind this module's calls (and
// those of the libraries it loads) to these definitions; off, each costs one relaxed load.
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

#include "executor/alloc_count.hpp"

namespace zoo {
static std::atomic<bool> counting{false};
static std::atomic<long> counted{0}, library_counted{0}, library_calls{0};
static thread_local int in_library = 0;  // LibraryCalls alive on this thread

void count_allocations(bool on) {
    if (on) {  // off keeps the counts for reading
        counted.store(0, std::memory_order_relaxed);
        library_counted.store(0, std::memory_order_relaxed);
        library_calls.store(0, std::memory_order_relaxed);
    }
    counting.store(on, std::memory_order_relaxed);
}
long allocations_counted() { return counted.load(std::memory_order_relaxed); }
long library_allocations_counted() { return library_counted.load(std::memory_order_relaxed); }
long library_calls_counted() { return library_calls.load(std::memory_order_relaxed); }

LibraryCall::LibraryCall() {
    if (counting.load(std::memory_order_relaxed)) library_calls.fetch_add(1, std::memory_order_relaxed);
    in_library++;
}
LibraryCall::~LibraryCall() { in_library--; }
}  // namespace zoo

static void* allocate(std::size_t n, std::size_t align) {
    if (zoo::counting.load(std::memory_order_relaxed))
        (zoo::in_library ? zoo::library_counted : zoo::counted).fetch_add(1, std::memory_order_relaxed);
    if (n == 0) n = 1;
    if (align <= alignof(std::max_align_t)) return std::malloc(n);
    return std::aligned_alloc(align, (n + align - 1) / align * align);
}

void* operator new(std::size_t n) {
    if (void* p = allocate(n, 0)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
    if (void* p = allocate(n, (std::size_t)a)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
    return allocate(n, (std::size_t)a);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
    return allocate(n, (std::size_t)a);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
