// Whether a small engine call runs on its calling thread alone or on all
// its compute threads. Each parallel region costs a wake-up of the other
// cores and a join: 0.4 us on some VMs, 3-5 us on others, and one VM may
// switch between the two within minutes (docs/PERFORMANCE.md). A 1 x 16
// bf16 call at E 256 has two regions and ~10 us of arithmetic on two
// cores: where a region costs 3 us, one thread alone is faster (27 against
// 32 us); where it costs 0.4 us, two threads are (20 against 27 us). So
// the choice is made from what recent calls of the same kind and size took
// each way, not from a fixed threshold.
#ifndef MHA_ENGINE_THREAD_CHOICE_H_
#define MHA_ENGINE_THREAD_CHOICE_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace mha {

// Owns, per (kind, size class), an exponential average of seconds per
// multiply-add for calls run on one thread and for calls run on all, and a
// count of the class's calls. A class's first calls alternate between the
// two ways; then each call takes the faster, except every kExploreEvery-th,
// which takes the other to keep its average current. Thread-safe: relaxed
// atomics (a lost update only delays an average by one call).
class ThreadChoice {
 public:
  // Calls of more multiply-adds than this always use all their threads.
  static constexpr double kMaxMacs = double{1 << 23};
  static constexpr int kKinds = 3;  // the compute types: f32, bf16, int8
  static constexpr int kExploreEvery = 32;

  // What Choose decided, for Record.
  struct Pick {
    int slot = -1;  // -1: not a candidate (all threads, nothing to record)
    bool serial = false;
  };

  // The process's instance, shared by every engine (the cores' cost of
  // waking each other is the machine's, not a model's).
  static ThreadChoice& Shared();

  // For a call of `macs` multiply-adds of compute type `kind` (0..2) that
  // would run on `threads` > 1 threads.
  Pick Choose(int kind, double macs, int threads);
  // The call of `pick` took `seconds`.
  void Record(const Pick& pick, double macs, double seconds);

  // The averages of a class (seconds per multiply-add; 0 before any call),
  // for tests.
  double SerialAverage(int kind, double macs) const;
  double ParallelAverage(int kind, double macs) const;

 private:
  static constexpr int kClasses = 12;  // log2 of macs: [12, 23]
  struct Class {
    std::atomic<double> serial{0.0}, parallel{0.0};
    std::atomic<uint32_t> calls{0};
  };
  static int SlotOf(int kind, double macs);

  std::array<Class, kKinds * kClasses> classes_;
};

// While one exists on a thread, that thread's calls use all their threads
// and record nothing (MhaEngine::WarmUp: its calls are cold).
class ScopedAllThreads {
 public:
  ScopedAllThreads();
  ~ScopedAllThreads();
  ScopedAllThreads(const ScopedAllThreads&) = delete;
  ScopedAllThreads& operator=(const ScopedAllThreads&) = delete;
  static bool Active();

 private:
  bool was_active_;
};

}  // namespace mha

#endif  // MHA_ENGINE_THREAD_CHOICE_H_
