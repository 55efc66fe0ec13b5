// The allocation counter of alloc_count.cpp (a test instrument).
#pragma once

namespace zoo {
void count_allocations(bool on);  // on: reset the counts and count from now; off: stop
long allocations_counted();       // zoo's own: every allocation outside a LibraryCall

// A call into a library that allocates on every call whatever its caller does (oneDNN 3.2's
// dnnl_primitive_execute builds its argument map, a std::unordered_map, and its execution
// context on the heap: 7 allocations a call). While one is alive on a thread, that thread's
// allocations are counted apart, with the calls, so that a test can hold zoo's own to zero and
// bound the library's per call.
struct LibraryCall {
    LibraryCall();
    ~LibraryCall();
    LibraryCall(const LibraryCall&) = delete;
    LibraryCall& operator=(const LibraryCall&) = delete;
};
long library_allocations_counted();
long library_calls_counted();
}  // namespace zoo
