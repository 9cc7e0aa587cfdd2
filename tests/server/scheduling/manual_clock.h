// A Clock that moves only when a test moves it.
#ifndef MHA_TESTS_MANUAL_CLOCK_H_
#define MHA_TESTS_MANUAL_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/scheduling/clock.h"

namespace mha::testing {

// Starts at an arbitrary fixed time; Advance moves it. Waiters poll it
// every millisecond of real time, so a batch whose delay has passed closes
// within about a millisecond of Advance and never before. Thread-safe.
class ManualClock final : public server::Clock {
 public:
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void WaitUntil(CondVar& cv, MutexLock& lock, absl::Time deadline) const override {
    if (Now() < deadline) cv.WaitFor(lock, absl::Milliseconds(1));
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'800'000'000);
};

}  // namespace mha::testing

#endif  // MHA_TESTS_MANUAL_CLOCK_H_
