// ForRange: a loop across the OpenMP team when it is worth it, or on the
// calling thread without touching OpenMP.
#ifndef MHA_ENGINE_OPS_PARALLEL_FOR_H_
#define MHA_ENGINE_OPS_PARALLEL_FOR_H_

#include <omp.h>

#include <cstdint>

namespace mha {

// body(i) for i in [0, n): statically shared across the team when
// `parallel`, outside any parallel region and with more than one thread to
// share with; otherwise in order on this thread, entering no region. Not
// an `if` clause: libgomp builds a team for a region whose `if` is false
// too, and inside another region (even a one-thread one: a session step's
// heads, a sequence of a ragged batch on a one-thread call) it allocates
// that team anew on every call and wakes futexes when it ends.
template <typename Body>
void ForRange(int64_t n, bool parallel, Body&& body) {
  if (parallel && omp_get_level() == 0 && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_PARALLEL_FOR_H_
