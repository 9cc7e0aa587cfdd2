// The batcher's notion of time, injectable so that tests control it.
#ifndef MHA_SERVER_SCHEDULING_CLOCK_H_
#define MHA_SERVER_SCHEDULING_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/mutex.h"

namespace mha::server {

// Tells the time and waits for it. Implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // Waits on `cv` (whose mutex `lock` holds) until it is notified or this
  // clock reaches `deadline`; may return early (callers re-check).
  virtual void WaitUntil(CondVar& cv, MutexLock& lock, absl::Time deadline) const = 0;
};

// absl::Now() and the condition variable's own timed wait. Stateless.
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void WaitUntil(CondVar& cv, MutexLock& lock, absl::Time deadline) const override {
    cv.WaitUntil(lock, deadline);
  }

  static const Clock& Get() {
    static const RealClock clock;
    return clock;
  }
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_CLOCK_H_
