// A bounded map that makes room by evicting its least recently used entry.
#ifndef MHA_ENGINE_OPS_LRU_CACHE_H_
#define MHA_ENGINE_OPS_LRU_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace mha {

// Owns at most `capacity` entries. Pointers and references to an entry stay
// valid until it is evicted. Each use may carry a tick (a clock shared with
// other caches), so that whoever bounds several caches together can ask
// which one holds the oldest entry. Not thread-safe: callers lock.
template <typename K, typename V>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The entry of `key`, now the most recently used (at `tick`), or nullptr.
  V* Find(const K& key, uint64_t tick = 0) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    it->second->used = tick;
    return &it->second->value;
  }

  // The entry of `key`, made (default-constructed) if absent, evicting the
  // least recently used entry when full; `inserted` tells which.
  V& FindOrInsert(const K& key, bool& inserted, uint64_t tick = 0) {
    if (V* found = Find(key, tick)) {
      inserted = false;
      return *found;
    }
    if (order_.size() >= capacity_) EvictOldest();
    order_.push_front(Entry{key, V(), tick});
    index_.emplace(key, order_.begin());
    inserted = true;
    return order_.front().value;
  }

  // The tick of the least recently used entry (the largest tick when empty).
  uint64_t OldestUse() const {
    return order_.empty() ? std::numeric_limits<uint64_t>::max() : order_.back().used;
  }
  // Forgets the least recently used entry; false when empty.
  bool EvictOldest() {
    if (order_.empty()) return false;
    index_.erase(order_.back().key);
    order_.pop_back();
    return true;
  }

  size_t size() const { return order_.size(); }

 private:
  struct Entry {
    K key;
    V value;
    uint64_t used = 0;
  };
  using Entries = std::list<Entry>;  // most recently used first
  size_t capacity_;
  Entries order_;
  absl::flat_hash_map<K, typename Entries::iterator> index_;
};

}  // namespace mha

#endif  // MHA_ENGINE_OPS_LRU_CACHE_H_
