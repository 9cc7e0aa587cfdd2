#include "server/scheduling/heap_trim.h"

#include <malloc.h>
#include <pthread.h>

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"
#include "engine/mutex.h"

namespace mha::server {

void TrimSchedule::Request(absl::Time now) {
  if (first_ == absl::InfiniteFuture()) first_ = now;
  last_ = std::max(last_, now);
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
    while (true) {
      const absl::Time due = schedule_.due();
      if (due == absl::InfiniteFuture()) {
        wake_.Wait(lock);
      } else if (absl::Now() < due) {
        wake_.WaitUntil(lock, due);
      } else {
        schedule_.Done();
        lock.Unlock();
        malloc_trim(0);
        lock.Lock();
      }
    }
  }

  Mutex mu_;
  CondVar wake_;
  TrimSchedule schedule_ ABSL_GUARDED_BY(mu_){kTrimQuiet, kTrimAtMost};
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
