// When the server's heap gives freed memory back to the system: fixed
// thresholds, a trim deferred until large requests stop, and a scope that
// gives back at once what a model's load or unload freed. The heap is
// TCMalloc's in mha_server (CMakeLists.txt, MHA_TCMALLOC), glibc's malloc in
// the tests' binaries and the sanitizer builds: each function here does
// what its name says with either.
//
// A page given back costs a fault when it is used again (12-18 us per 4 KiB
// page on a paravirtual guest). Trimming after every large request made the
// next one fault in gRPC's receive buffers, the HTTP body and the answer
// afresh: 4,000 faults and 60-90 ms of a 16 MiB call's 80-107 ms above its
// compute (AMD EPYC VM, docs/PERFORMANCE.md). So freed memory is kept while
// large requests come, and given back once they stop.
#ifndef MHA_SERVER_SCHEDULING_HEAP_TRIM_H_
#define MHA_SERVER_SCHEDULING_HEAP_TRIM_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "engine/large_buffer.h"

namespace mha::server {

// The thresholds themselves are engine/large_buffer.h's (SetHeapThresholds,
// called in main). An arena's free top while a TightHeapTrim lives:
inline constexpr int kTightHeapTrimThreshold = 4 << 20;

// When a deferred trim is due: `quiet` after the last request, while no
// large work is running, and no later than `at_most` after the first
// request not trimmed yet (large requests that never stop still see their
// freed memory given back). Unexplained memory (the resident set less what
// the server holds on purpose: SetHeldBytesReader) grown by `growth` above
// its lowest level after a trim is a request too: small requests of many
// sizes beside session steps, on many threads, leave free memory in the
// heap that no large request asks to trim (with glibc's malloc such a mixed
// load grew the server by 0.37 MB/s, more than 1 GB an hour;
// docs/RELIABILITY.md, "Memory"). The lowest level, not the last: a trim
// made while requests were in flight would otherwise raise the bar step by
// step. An idle spell with free heap is one more (Activity). Not
// thread-safe.
class TrimSchedule {
 public:
  TrimSchedule(absl::Duration quiet, absl::Duration at_most, int64_t growth = 0)
      : quiet_(quiet), at_most_(at_most), growth_(growth) {}

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
  // The unexplained memory read at `now` (every kResidentCheck): more than
  // `growth` above the lowest level after a trim (or the first reading), a
  // trim is requested.
  void Resident(absl::Time now, int64_t bytes);
  // At each check: whether the process has been idle since the last one
  // (kIdleCpu), and the heap's free bytes. The first check of an idle
  // spell that finds more than kIdleHeapFree free requests a trim: what a
  // load of small requests left in the allocator's caches goes back once
  // it stops, with no large request to ask for it.
  void Activity(absl::Time now, bool idle, int64_t heap_free);
  // The trim is being made (what is requested from now on is for the next).
  void Done() { first_ = absl::InfiniteFuture(); }
  // The unexplained memory once it was made: the baseline of Resident's
  // growth when it is the lowest yet.
  void Trimmed(int64_t after) {
    if (after > 0 && (resident_after_trim_ == 0 || after < resident_after_trim_)) {
      resident_after_trim_ = after;
    }
  }

 private:
  const absl::Duration quiet_, at_most_;
  const int64_t growth_;  // 0: the resident set requests nothing
  int64_t resident_after_trim_ = 0;
  bool idle_trim_requested_ = false;  // in this idle spell
  int running_ = 0;
  absl::Time first_ = absl::InfiniteFuture();  // the first request not trimmed yet
  absl::Time last_ = absl::InfinitePast();
};

// GiveBackFreeHeap() once large work stops: kTrimQuiet after the last piece is
// done with none running (and at most kTrimAtMost after the first not
// trimmed yet), on a thread of its own. Thread-safe; each returns at once.
inline constexpr absl::Duration kTrimQuiet = absl::Seconds(2);
inline constexpr absl::Duration kTrimAtMost = absl::Seconds(10);
// The trim thread reads the resident set this often, and asks for a trim
// once it has grown this much since the last trim.
inline constexpr absl::Duration kResidentCheck = absl::Seconds(5);
inline constexpr int64_t kResidentGrowthTrim = int64_t{4} << 20;
// The process is idle when it used less CPU than this between two checks
// (1 % of a core; an idle server uses ~0.1 %), and then a heap holding more
// than kIdleHeapFree free is trimmed.
inline constexpr absl::Duration kIdleCpu = absl::Milliseconds(50);
inline constexpr int64_t kIdleHeapFree = int64_t{4} << 20;
// Starts the trim thread now, so that it reads the resident set from the
// start (else it starts at the first large request), with what the server
// holds on purpose (`held`: thread-safe; its growth is not the heap's).
// Called once by the Server.
void StartHeapTrims(std::function<int64_t()> held);
// "tcmalloc" or "glibc": the malloc this process runs on.
const char* HeapAllocatorName();
// Gives every free page of the heap back to the system now (glibc:
// malloc_trim(0); TCMalloc: ReleaseFreeMemory, its page heap's free spans).
// Between these, TCMalloc gives free spans back on its own, gradually
// (TCMALLOC_RELEASE_RATE).
void GiveBackFreeHeap();
// The free bytes the heap holds: glibc, mallinfo2's fordblks (resident or
// given back by a trim); TCMalloc, its heap less what is allocated and what
// it has given back (its caches and free spans, resident).
int64_t HeapFreeBytes();
// A large request started (its memory reserved) / it is done.
void LargeWorkStarted();
void LargeWorkDone();
// Something large was freed outside a request (a workspace given back).
void TrimHeapSoon();

// While one lives, arenas keep at most kTightHeapTrimThreshold of free top;
// when the last one ends, the thresholds are restored and GiveBackFreeHeap()
// gives back the rest (TCMalloc has no such threshold: all at the end). For
// a model's load and unload: the unpacked weights and the scratch freed
// there go back at once, whichever arena held them (malloc_trim alone
// leaves a thread arena's top). Thread-safe; neither copied nor moved.
class TightHeapTrim {
 public:
  TightHeapTrim();
  ~TightHeapTrim();
  TightHeapTrim(const TightHeapTrim&) = delete;
  TightHeapTrim& operator=(const TightHeapTrim&) = delete;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_HEAP_TRIM_H_
