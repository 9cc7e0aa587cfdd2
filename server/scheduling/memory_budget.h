// The server-wide memory budget for requests in flight, and where its
// default limit comes from (a container's cgroup limit, RLIMIT_AS, or the
// machine's physical memory).
#ifndef MHA_SERVER_SCHEDULING_MEMORY_BUDGET_H_
#define MHA_SERVER_SCHEDULING_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "engine/mutex.h"
#include "prometheus/gauge.h"

namespace mha::server {

// A memory limit and what it was derived from, for the ready line.
struct MemoryLimit {
  int64_t bytes = 0;
  std::string source;  // e.g. "75% of cgroup memory.max (4,294,967,296)"
};

// `flag_bytes` > 0 is taken as given; 0 means 75 % of the tightest of the
// cgroup's memory limit (v2 memory.max or v1 memory.limit_in_bytes), the
// address space RLIMIT_AS leaves above what the process maps now (less
// 1 GiB for thread stacks and allocator arenas), and physical memory.
MemoryLimit ResolveMemoryLimit(int64_t flag_bytes);

// The process's resident memory now (VmRSS), or 0 if unknown.
int64_t ResidentBytes();

// 1234567 -> "1,234,567": byte counts people read in error messages.
std::string WithCommas(int64_t n);

class MemoryBudget;

// Bytes held against a MemoryBudget, given back when destroyed. A
// reservation starts as "queued" (a request waiting) and may grow into
// "active" bytes (computing or answering: they come back without anyone's
// help). Movable; not thread-safe (one owner at a time).
class MemoryReservation {
 public:
  MemoryReservation() = default;
  MemoryReservation(MemoryReservation&& other) noexcept { *this = std::move(other); }
  MemoryReservation& operator=(MemoryReservation&& other) noexcept;
  ~MemoryReservation() { Release(); }

  int64_t bytes() const { return queued_ + active_; }
  void Release();

 private:
  friend class MemoryBudget;
  MemoryBudget* budget_ = nullptr;
  int64_t queued_ = 0, active_ = 0;
  bool large_ = false;  // counted as large work (heap_trim.h) until released
};

// Counts the working memory of requests in flight (queued, computing,
// answering) against `limit` minus a fixed `reserve` (the engines' own
// scratch and caches). Never blocks a caller except in WaitForRelease.
// Thread-safe.
class MemoryBudget {
 public:
  // `reserved_gauge` (may be null) follows the bytes reserved.
  MemoryBudget(int64_t limit, prometheus::Gauge* reserved_gauge = nullptr);

  // Set after the models are loaded, and again after each load or unload:
  // what requests may hold follows what the models hold.
  void SetReserve(int64_t reserve) { reserve_ = reserve; }
  int64_t limit() const { return limit_; }
  int64_t reserve() const { return reserve_; }
  // What requests may hold at once.
  int64_t capacity() const { return limit_ - reserve_; }
  int64_t reserved() const;
  // Bytes of computing or answering requests (they come back by themselves).
  int64_t active() const;

  // Reserves `bytes` of queued memory; false (nothing reserved) when it
  // would pass the capacity.
  bool TryReserveQueued(int64_t bytes, MemoryReservation& into);
  // What TryGrowActive did. When the bytes do not fit, whether active
  // bytes were held at that moment (they will come back: worth waiting)
  // is decided under the same lock: reading active() after a refusal
  // races with a batch that finishes in between.
  enum class Growth { kGrown, kFullUntilActiveReturns, kFull };
  // Adds `bytes` of active memory to a reservation, unless it would pass
  // the capacity.
  Growth TryGrowActive(int64_t bytes, MemoryReservation& into);
  // A request refused or dropped after it left the queue: its queued bytes
  // now come back by themselves, so they count as active (another worker
  // deciding whether to wait must not take them for a queue that holds
  // memory for good).
  void MarkLeaving(MemoryReservation& reservation);
  // Waits up to `timeout` for memory to be given back.
  void WaitForRelease(absl::Duration timeout);

 private:
  friend class MemoryReservation;
  void Release(int64_t queued, int64_t active);
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // with mu_ held

  const int64_t limit_;
  std::atomic<int64_t> reserve_{0};
  prometheus::Gauge* const reserved_gauge_;
  mutable Mutex mu_;
  CondVar released_;
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_MEMORY_BUDGET_H_
