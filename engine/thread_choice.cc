#include "engine/thread_choice.h"

#include <algorithm>
#include <cmath>

namespace mha {
namespace {

thread_local bool all_threads_scope = false;

// A sample below the average moves it halfway (a cold first call, or a
// machine that got faster, is forgotten within a few calls); one above
// moves it an eighth of the way, and counts at most twice the average (one
// preempted call does not flip the choice).
double Blend(double average, double sample) {
  if (average == 0.0) return sample;
  if (sample < average) return 0.5 * (average + sample);
  return average + (std::min(sample, 2.0 * average) - average) / 8.0;
}

}  // namespace

ThreadChoice& ThreadChoice::Shared() {
  static ThreadChoice* shared = new ThreadChoice();
  return *shared;
}

int ThreadChoice::SlotOf(int kind, double macs) {
  const int size_class = std::clamp(std::ilogb(std::max(macs, 1.0)) - 12, 0, kClasses - 1);
  return std::clamp(kind, 0, kKinds - 1) * kClasses + size_class;
}

ThreadChoice::Pick ThreadChoice::Choose(int kind, double macs, int threads) {
  if (threads <= 1 || !(macs <= kMaxMacs) || ScopedAllThreads::Active()) return {};
  const int slot = SlotOf(kind, macs);
  Class& c = classes_[slot];
  const uint32_t n = c.calls.fetch_add(1, std::memory_order_relaxed);
  const double serial = c.serial.load(std::memory_order_relaxed);
  const double parallel = c.parallel.load(std::memory_order_relaxed);
  // Each way once first (all threads first: the way calls ran before).
  if (parallel == 0.0) return {slot, false};
  if (serial == 0.0) return {slot, true};
  const bool serial_faster = serial < parallel;
  return {slot, n % kExploreEvery == 0 ? !serial_faster : serial_faster};
}

void ThreadChoice::Record(const Pick& pick, double macs, double seconds) {
  if (pick.slot < 0 || !(macs > 0.0) || !(seconds >= 0.0)) return;
  Class& c = classes_[pick.slot];
  std::atomic<double>& average = pick.serial ? c.serial : c.parallel;
  average.store(Blend(average.load(std::memory_order_relaxed), seconds / macs),
                std::memory_order_relaxed);
}

double ThreadChoice::SerialAverage(int kind, double macs) const {
  return classes_[SlotOf(kind, macs)].serial.load(std::memory_order_relaxed);
}

double ThreadChoice::ParallelAverage(int kind, double macs) const {
  return classes_[SlotOf(kind, macs)].parallel.load(std::memory_order_relaxed);
}

ScopedAllThreads::ScopedAllThreads() : was_active_(all_threads_scope) { all_threads_scope = true; }
ScopedAllThreads::~ScopedAllThreads() { all_threads_scope = was_active_; }
bool ScopedAllThreads::Active() { return all_threads_scope; }

}  // namespace mha
