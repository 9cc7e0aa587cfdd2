// A Clock that moves only when a test moves it.
#ifndef MHA_TESTS_MANUAL_CLOCK_H_
#define MHA_TESTS_MANUAL_CLOCK_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

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
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline) const override {
    if (Now() < deadline) cv.wait_for(lock, std::chrono::milliseconds(1));
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
