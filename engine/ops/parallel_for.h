// ForRange: a loop across the OpenMP team when it is worth it, or on the
// calling thread without touching OpenMP. CutIntoRuns: items shared out as
// runs of neighbours of about equal work.
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

// Items [first, end) cut into `threads` runs of neighbours with about
// equal work: thread t takes [bounds[t], bounds[t + 1]), bounds[0] = first,
// bounds[threads] = end. `walk(visit)` calls visit(work) for each item in
// order, once per call (it is called twice). An item goes to the next run
// when more than half of it lies past the current run's share.
template <typename Walk>
void CutIntoRuns(int64_t first, int64_t end, int64_t threads, Walk&& walk, int64_t* bounds) {
  int64_t total = 0;
  walk([&](int64_t work) { total += work; });
  for (int64_t t = 0; t <= threads; ++t) bounds[t] = end;
  bounds[0] = first;
  int64_t item = first, done = 0, t = 1;
  walk([&](int64_t work) {
    // 2 (done + work / 2) > total t / threads, in integers.
    while (t < threads && (2 * done + work) * threads > 2 * total * t) bounds[t++] = item;
    done += work;
    ++item;
  });
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_PARALLEL_FOR_H_
