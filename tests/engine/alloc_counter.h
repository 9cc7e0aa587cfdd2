// Heap allocation counts for tests and benchmarks. Linking this library
// replaces the program's operator new with a counting one and wraps
// dnnl_primitive_execute (-Wl,--wrap, which the library's link options add)
// so the allocations oneDNN 2.6 makes inside every execute (an argument map
// it builds per call, which no API of 2.6 avoids) can be told from ours.
// Thread-safe (atomic counters over the whole process).
#ifndef MHA_TESTS_ALLOC_COUNTER_H_
#define MHA_TESTS_ALLOC_COUNTER_H_

#include <cstdint>

namespace mha::testing {

struct AllocationCounts {
  int64_t all = 0;                // operator new calls
  int64_t in_onednn_execute = 0;  // of those, made inside dnnl_primitive_execute
  int64_t executes = 0;           // dnnl_primitive_execute calls

  int64_t outside_onednn_execute() const { return all - in_onednn_execute; }
  AllocationCounts operator-(const AllocationCounts& before) const {
    return {all - before.all, in_onednn_execute - before.in_onednn_execute,
            executes - before.executes};
  }
  AllocationCounts operator+(const AllocationCounts& more) const {
    return {all + more.all, in_onednn_execute + more.in_onednn_execute, executes + more.executes};
  }
};

// The counts since the program started.
AllocationCounts CurrentAllocationCounts();

}  // namespace mha::testing

#endif  // MHA_TESTS_ALLOC_COUNTER_H_
