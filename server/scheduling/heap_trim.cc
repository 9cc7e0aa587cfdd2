#include "server/scheduling/heap_trim.h"

#include <malloc.h>
#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "engine/mutex.h"
#include "server/scheduling/memory_budget.h"

// TCMalloc's extension interface (gperftools), when TCMalloc is the
// process's malloc (linked into mha_server: CMakeLists.txt); null otherwise
// (glibc's malloc, or a sanitizer's).
extern "C" {
void MallocExtension_ReleaseFreeMemory() __attribute__((weak));
int MallocExtension_GetNumericProperty(const char* property, size_t* value) __attribute__((weak));
}

namespace mha::server {
namespace {

bool Tcmalloc() { return MallocExtension_ReleaseFreeMemory != nullptr; }

size_t TcmallocProperty(const char* name) {
  size_t value = 0;
  return MallocExtension_GetNumericProperty(name, &value) != 0 ? value : 0;
}

}  // namespace

const char* HeapAllocatorName() { return Tcmalloc() ? "tcmalloc" : "glibc"; }

void GiveBackFreeHeap() {
  if (Tcmalloc()) {
    MallocExtension_ReleaseFreeMemory();
  } else {
    malloc_trim(0);
  }
}

int64_t HeapFreeBytes() {
  if (!Tcmalloc()) return static_cast<int64_t>(mallinfo2().fordblks);
  const size_t heap = TcmallocProperty("generic.heap_size");
  const size_t used = TcmallocProperty("generic.current_allocated_bytes") +
                      TcmallocProperty("tcmalloc.pageheap_unmapped_bytes");
  return heap > used ? static_cast<int64_t>(heap - used) : 0;
}

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

void TrimSchedule::Activity(absl::Time now, bool idle, int64_t heap_free) {
  if (!idle) {
    idle_trim_requested_ = false;
  } else if (!idle_trim_requested_ && heap_free > kIdleHeapFree) {
    idle_trim_requested_ = true;
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
    absl::Duration last_cpu = ProcessCpuTime();
    while (true) {
      absl::Time now = absl::Now();
      if (now >= next_check) {
        const std::function<int64_t()> held = held_;
        lock.Unlock();  // the readers take locks of their own
        const int64_t unexplained = Unexplained(held);
        const absl::Duration cpu = ProcessCpuTime();
        const int64_t heap_free = HeapFreeBytes();
        lock.Lock();
        now = absl::Now();
        schedule_.Resident(now, unexplained);
        schedule_.Activity(now, cpu - last_cpu < kIdleCpu, heap_free);
        last_cpu = cpu;
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
      GiveBackFreeHeap();
      const int64_t after = Unexplained(held);
      lock.Lock();
      schedule_.Trimmed(after);
    }
  }

  // The user and system time of every thread of the process so far.
  static absl::Duration ProcessCpuTime() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return absl::DurationFromTimeval(usage.ru_utime) + absl::DurationFromTimeval(usage.ru_stime);
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
  GiveBackFreeHeap();
}

}  // namespace mha::server
