// The lock every guarded member in engine/ and server/ names, so that clang's
// -Wthread-safety checks at compile time that it is held (ABSL_GUARDED_BY,
// ABSL_EXCLUSIVE_LOCKS_REQUIRED). It is std::mutex with Abseil's annotations,
// not absl::Mutex: Debian's libabsl is not built with ThreadSanitizer, so TSan
// would not see absl::Mutex's lock and unlock and would report a race on every
// member it guards, while it intercepts std::mutex.
#ifndef MHA_ENGINE_MUTEX_H_
#define MHA_ENGINE_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace mha {

// An exclusive lock. Thread-safe; not copyable.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the analysis that this mutex is held where it cannot see so: the
  // same mutex reached by another path (a step's manager is `this`).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class MutexLock;
  std::mutex mu_;
};

// Holds a Mutex for its scope; Unlock() and Lock() release and retake it in
// between (for work that must not run under the lock). One thread's object.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : lock_(mu.mu_) {}
  ~MutexLock() ABSL_UNLOCK_FUNCTION() = default;
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() ABSL_UNLOCK_FUNCTION() { lock_.unlock(); }
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { lock_.lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

// A condition variable waited on with a MutexLock held. Waits may return
// early (spuriously): callers re-check their condition in a loop, written in
// the function that holds the lock so that the analysis sees the reads.
// Thread-safe.
class CondVar {
 public:
  void Wait(MutexLock& lock) { cv_.wait(lock.lock_); }
  void WaitFor(MutexLock& lock, absl::Duration timeout) {
    cv_.wait_for(lock.lock_, absl::ToChronoNanoseconds(timeout));
  }
  void WaitUntil(MutexLock& lock, absl::Time deadline) {
    cv_.wait_until(lock.lock_, absl::ToChronoTime(deadline));
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace mha

#endif  // MHA_ENGINE_MUTEX_H_
