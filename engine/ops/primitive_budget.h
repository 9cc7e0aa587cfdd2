// How many oneDNN primitives the engines' caches keep, process-wide. Each
// distinct shape's primitive holds its JIT code and descriptors (~109 KiB
// measured at E = 256), and a busy model sees many shapes: per-cache bounds
// alone would let a thousand models, or one model fed many lengths, hold
// gigabytes. One capacity for all caches, least recently used out first
// whichever cache holds it, bounds their memory by one number, which the
// server reserves (MhaEngine::kPrimitiveCacheBytes).
#ifndef MHA_ENGINE_OPS_PRIMITIVE_BUDGET_H_
#define MHA_ENGINE_OPS_PRIMITIVE_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <list>

#include "engine/mutex.h"

namespace mha {

// Owns the registry of caches and the count of primitives they hold (not
// the caches, which register and unregister themselves). Thread-safe. Lock
// order: the registry's lock, then one cache's at a time; a cache never
// calls in here while holding its own lock.
class PrimitiveBudget {
 public:
  // The default capacity, and what one primitive is taken to hold.
  static constexpr int64_t kDefaultCapacity = 512;
  static constexpr int64_t kBytesPerPrimitive = int64_t{112} << 10;

  // A cache of primitives the budget may ask to give one back.
  class Cache {
   public:
    virtual ~Cache() = default;
    // The tick of its least recently used primitive (max when empty).
    virtual uint64_t OldestUse() const = 0;
    // Forgets that primitive (in-flight users keep theirs); false if empty.
    virtual bool EvictOldest() = 0;
  };

  static PrimitiveBudget& Get();

  void Register(Cache* cache);
  // After it returns, the budget never calls `cache` again; then the cache
  // gives its count back (Removed).
  void Unregister(Cache* cache);
  void Removed(int64_t held) { held_.fetch_sub(held, std::memory_order_relaxed); }
  // The clock of uses shared by every cache.
  uint64_t Tick() { return clock_.fetch_add(1, std::memory_order_relaxed) + 1; }
  // A cache holds `added` more (outside its lock): while the count passes
  // the capacity, the least recently used primitive of any cache goes.
  void Added(int64_t added);

  int64_t held() const { return held_.load(std::memory_order_relaxed); }
  int64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  // For tests and tools; evicts down to it at the next Added.
  void set_capacity(int64_t capacity) { capacity_.store(capacity < 1 ? 1 : capacity); }
  // Primitives given back for the capacity since the start.
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }

 private:
  PrimitiveBudget() = default;

  Mutex mu_;
  std::list<Cache*> caches_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> clock_{0};
  std::atomic<int64_t> held_{0};
  std::atomic<int64_t> capacity_{kDefaultCapacity};
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace mha

#endif  // MHA_ENGINE_OPS_PRIMITIVE_BUDGET_H_
