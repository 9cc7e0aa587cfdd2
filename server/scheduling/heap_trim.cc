#include "server/scheduling/heap_trim.h"

#include <malloc.h>
#include <pthread.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "engine/mutex.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

void TrimSchedule::Request(absl::Time now) {
  if (first_ == absl::InfiniteFuture()) first_ = now;
  last_ = std::max(last_, now);
}

void TrimSchedule::Resident(absl::Time now, int64_t bytes) {
  if (growth_ <= 0 || bytes <= 0) return;
  if (resident_after_trim_ == 0) {
    resident_after_trim_ = bytes;  // the first reading: the baseline
  } else if (bytes > resident_after_trim_ + growth_) {
    Request(now);
  }
}

absl::Time TrimSchedule::due() const {
  if (first_ == absl::InfiniteFuture()) return absl::InfiniteFuture();
  if (running_ > 0) return first_ + at_most_;
  return std::min(last_ + quiet_, first_ + at_most_);
}

namespace {

// Owns the thread that makes the deferred trims (TrimHeapSoon) and their
// schedule. Never destroyed: requests may end while the process exits.
// Thread-safe.
class DeferredTrim {
 public:
  DeferredTrim() {
    std::thread([this] { Loop(); }).detach();
  }

  void Started() {
    MutexLock lock(mu_);
    schedule_.Started();
  }
  void Finished() {
    MutexLock lock(mu_);
    schedule_.Finished(absl::Now());
    wake_.NotifyOne();
  }
  void Request() {
    MutexLock lock(mu_);
    schedule_.Request(absl::Now());
    wake_.NotifyOne();
  }

 private:
  void Loop() {
    pthread_setname_np(pthread_self(), "mha-heap-trim");
    MutexLock lock(mu_);
    absl::Time next_check = absl::Now();
    while (true) {
      absl::Time now = absl::Now();
      if (now >= next_check) {
        const std::function<int64_t()> held = held_;
        lock.Unlock();  // the readers take locks of their own
        const int64_t unexplained = Unexplained(held);
        lock.Lock();
        now = absl::Now();
        schedule_.Resident(now, unexplained);
        next_check = now + kResidentCheck;
      }
      const absl::Time due = schedule_.due();
      if (now < due) {
        wake_.WaitUntil(lock, std::min(due, next_check));
        continue;
      }
      schedule_.Done();
      const std::function<int64_t()> held = held_;
      lock.Unlock();
      malloc_trim(0);
      const int64_t after = Unexplained(held);
      lock.Lock();
      schedule_.Trimmed(after);
    }
  }

  // The resident set less what `held` says is held on purpose.
  static int64_t Unexplained(const std::function<int64_t()>& held) {
    const int64_t resident = ResidentBytes();
    return resident <= 0 ? 0 : std::max<int64_t>(1, resident - (held ? held() : 0));
  }

 public:
  void SetHeld(std::function<int64_t()> held) {
    MutexLock lock(mu_);
    held_ = std::move(held);
  }

 private:
  Mutex mu_;
  CondVar wake_;
  TrimSchedule schedule_ ABSL_GUARDED_BY(mu_){kTrimQuiet, kTrimAtMost, kResidentGrowthTrim};
  std::function<int64_t()> held_ ABSL_GUARDED_BY(mu_);
};

// How many TightHeapTrim scopes are open. Thread-safe.
struct TightScopes {
  Mutex mu;
  int open ABSL_GUARDED_BY(mu) = 0;
};

TightScopes& Tight() {
  static TightScopes* const scopes = new TightScopes();  // never destroyed
  return *scopes;
}

DeferredTrim& Deferred() {
  static DeferredTrim* const trim = new DeferredTrim();  // never destroyed
  return *trim;
}

}  // namespace

void LargeWorkStarted() { Deferred().Started(); }
void LargeWorkDone() { Deferred().Finished(); }
void TrimHeapSoon() { Deferred().Request(); }
void StartHeapTrims(std::function<int64_t()> held) { Deferred().SetHeld(std::move(held)); }
int64_t HeapFreeBytes() { return static_cast<int64_t>(mallinfo2().fordblks); }

TightHeapTrim::TightHeapTrim() {
  TightScopes& scopes = Tight();
  MutexLock lock(scopes.mu);
  if (scopes.open++ == 0) mallopt(M_TRIM_THRESHOLD, kTightHeapTrimThreshold);
}

TightHeapTrim::~TightHeapTrim() {
  TightScopes& scopes = Tight();
  {
    MutexLock lock(scopes.mu);
    if (--scopes.open > 0) return;
    mallopt(M_TRIM_THRESHOLD, kHeapTrimThreshold);
  }
  malloc_trim(0);
}

}  // namespace mha::server
