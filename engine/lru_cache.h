// A bounded map that makes room by evicting its least recently used entry.
#ifndef MHA_ENGINE_LRU_CACHE_H_
#define MHA_ENGINE_LRU_CACHE_H_

#include <cstddef>
#include <list>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace mha {

// Owns at most `capacity` entries. Pointers and references to an entry stay
// valid until it is evicted. Not thread-safe: callers lock.
template <typename K, typename V>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The entry of `key`, now the most recently used, or nullptr.
  V* Find(const K& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }

  // The entry of `key`, made (default-constructed) if absent, evicting the
  // least recently used entry when full; `inserted` tells which.
  V& FindOrInsert(const K& key, bool& inserted) {
    if (V* found = Find(key)) {
      inserted = false;
      return *found;
    }
    if (order_.size() >= capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    order_.emplace_front(key, V());
    index_.emplace(key, order_.begin());
    inserted = true;
    return order_.front().second;
  }

  size_t size() const { return order_.size(); }

 private:
  using Entries = std::list<std::pair<K, V>>;  // most recently used first
  size_t capacity_;
  Entries order_;
  absl::flat_hash_map<K, typename Entries::iterator> index_;
};

}  // namespace mha

#endif  // MHA_ENGINE_LRU_CACHE_H_
