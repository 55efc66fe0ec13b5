// The allocation counter of alloc_count.cpp (a test instrument).
#pragma once

namespace zoo {
void count_allocations(bool on);  // resets the count; on: count from now
long allocations_counted();
}  // namespace zoo
