#include "engine/ops/primitive_budget.h"

#include <limits>

namespace mha {

PrimitiveBudget& PrimitiveBudget::Get() {
  static PrimitiveBudget* budget = new PrimitiveBudget();  // never destroyed
  return *budget;
}

void PrimitiveBudget::Register(Cache* cache) {
  MutexLock lock(mu_);
  caches_.push_back(cache);
}

void PrimitiveBudget::Unregister(Cache* cache) {
  MutexLock lock(mu_);
  caches_.remove(cache);
}

void PrimitiveBudget::Added(int64_t added) {
  if (held_.fetch_add(added, std::memory_order_relaxed) + added <= capacity()) return;
  MutexLock lock(mu_);
  while (held() > capacity()) {
    // The cache whose least recently used primitive is the oldest of all:
    // a scan (misses only; a few thousand caches at a thousand models).
    Cache* oldest = nullptr;
    uint64_t oldest_use = std::numeric_limits<uint64_t>::max();
    for (Cache* cache : caches_) {
      const uint64_t use = cache->OldestUse();  // max: empty
      if (use < oldest_use) {
        oldest = cache;
        oldest_use = use;
      }
    }
    if (oldest == nullptr || !oldest->EvictOldest()) return;  // nothing left to give
    held_.fetch_sub(1, std::memory_order_relaxed);
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace mha
