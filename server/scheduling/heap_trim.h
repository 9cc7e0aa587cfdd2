// When the server's heap (glibc's malloc) gives freed memory back to the
// system: fixed thresholds, a trim deferred until large requests stop, and
// a scope that gives back at once what a model's load or unload freed.
//
// A page given back costs a fault when it is used again (12-18 us per 4 KiB
// page on a paravirtual guest). Trimming after every large request made the
// next one fault in gRPC's receive buffers, the HTTP body and the answer
// afresh: 4,000 faults and 60-90 ms of a 16 MiB call's 80-107 ms above its
// compute (AMD EPYC VM, docs/PERFORMANCE.md). So freed memory is kept while
// large requests come, and given back once they stop.
#ifndef MHA_SERVER_SCHEDULING_HEAP_TRIM_H_
#define MHA_SERVER_SCHEDULING_HEAP_TRIM_H_

#include "absl/time/time.h"
#include "engine/large_buffer.h"

namespace mha::server {

// The thresholds themselves are engine/large_buffer.h's (SetHeapThresholds,
// called in main). An arena's free top while a TightHeapTrim lives:
inline constexpr int kTightHeapTrimThreshold = 4 << 20;

// When a deferred trim is due: `quiet` after the last request, while no
// large work is running, and no later than `at_most` after the first
// request not trimmed yet (large requests that never stop still see their
// freed memory given back). Not thread-safe.
class TrimSchedule {
 public:
  TrimSchedule(absl::Duration quiet, absl::Duration at_most) : quiet_(quiet), at_most_(at_most) {}

  // Large work started: a trim now would give back what it is about to
  // reuse (its answer's buffers).
  void Started() { ++running_; }
  // Large work finished at `now`, having freed memory worth a trim.
  void Finished(absl::Time now) {
    --running_;
    Request(now);
  }
  // Memory worth a trim was freed at `now` outside counted work (a
  // workspace given back).
  void Request(absl::Time now);
  // When the pending trim is due; InfiniteFuture when none is pending.
  absl::Time due() const;
  // The trim was made.
  void Done() { first_ = absl::InfiniteFuture(); }

 private:
  const absl::Duration quiet_, at_most_;
  int running_ = 0;
  absl::Time first_ = absl::InfiniteFuture();  // the first request not trimmed yet
  absl::Time last_ = absl::InfinitePast();
};

// malloc_trim(0) once large work stops: kTrimQuiet after the last piece is
// done with none running (and at most kTrimAtMost after the first not
// trimmed yet), on a thread of its own. Thread-safe; each returns at once.
inline constexpr absl::Duration kTrimQuiet = absl::Seconds(2);
inline constexpr absl::Duration kTrimAtMost = absl::Seconds(10);
// A large request started (its memory reserved) / it is done.
void LargeWorkStarted();
void LargeWorkDone();
// Something large was freed outside a request (a workspace given back).
void TrimHeapSoon();

// While one lives, arenas keep at most kTightHeapTrimThreshold of free top;
// when the last one ends, the thresholds are restored and malloc_trim(0)
// gives back the rest. For a model's load and unload: the unpacked weights
// and the scratch freed there go back at once, whichever arena held them
// (malloc_trim alone leaves a thread arena's top). Thread-safe; neither
// copied nor moved.
class TightHeapTrim {
 public:
  TightHeapTrim();
  ~TightHeapTrim();
  TightHeapTrim(const TightHeapTrim&) = delete;
  TightHeapTrim& operator=(const TightHeapTrim&) = delete;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_HEAP_TRIM_H_
