// Compiled, not run, by deploy/debian/thread_safety_check.sh: with clang's
// -Werror=thread-safety this file compiles, and with
// -DMHA_PLANT_UNGUARDED_READ it must not (a guarded member read without its
// lock). The pair shows that engine/mutex.h's annotations reach the
// compiler, and that the failure is the planted read, not the setup.
#include "engine/mutex.h"

namespace {

// A counter whose value only its lock may touch. Thread-safe.
class Counter {
 public:
  void Add(int n) {
    mha::MutexLock lock(mu_);
    value_ += n;
  }
#ifdef MHA_PLANT_UNGUARDED_READ
  int Read() { return value_; }  // planted: no lock held
#else
  int Read() {
    mha::MutexLock lock(mu_);
    return value_;
  }
#endif

 private:
  mha::Mutex mu_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

int main() {
  Counter counter;
  counter.Add(1);
  return counter.Read() == 1 ? 0 : 1;
}
