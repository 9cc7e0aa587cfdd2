#include "engine/kv_cache.h"

#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"

namespace mha {

void KvBlockPool::FreeAligned::operator()(uint8_t* p) const { std::free(p); }

uint8_t* KvBlockPool::Acquire(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto same = free_.find(bytes);
  if (same != free_.end() && !same->second.empty()) {
    uint8_t* block = same->second.back().release();
    same->second.pop_back();
    in_use_ += bytes;
    return block;
  }
  // Room for a new block: first from kept blocks of other sizes.
  for (auto it = free_.begin(); held_ + bytes > budget_ && it != free_.end(); ++it) {
    while (held_ + bytes > budget_ && !it->second.empty()) {
      it->second.pop_back();
      held_ -= it->first;
    }
  }
  if (held_ + bytes > budget_) return nullptr;
  const size_t rounded = static_cast<size_t>((bytes + 63) / 64 * 64);
  auto* block = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
  if (block == nullptr) return nullptr;
  held_ += bytes;
  in_use_ += bytes;
  return block;
}

void KvBlockPool::Release(uint8_t* block, int64_t bytes) {
  if (block == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= bytes;
  free_[bytes].emplace_back(block);
}

int64_t KvBlockPool::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

int64_t KvBlockPool::bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

KvCache::~KvCache() {
  for (uint8_t* block : blocks_) pool_.Release(block, layout_.block_bytes());
}

absl::Status KvCache::Reserve(int64_t tokens) {
  const int64_t had = num_blocks();
  const int64_t needed = layout_.BlocksFor(tokens);
  while (num_blocks() < needed) {
    uint8_t* block = pool_.Acquire(layout_.block_bytes());
    if (block == nullptr) {
      while (num_blocks() > had) {
        pool_.Release(blocks_.back(), layout_.block_bytes());
        blocks_.pop_back();
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "session cache full: ", (needed - had) * layout_.block_bytes(), " more bytes needed, ",
          pool_.bytes_in_use(), " of ", pool_.budget(), " in use"));
    }
    blocks_.push_back(block);
  }
  return absl::OkStatus();
}

void KvCache::ReleaseUnused() {
  const int64_t keep = layout_.BlocksFor(length_);
  while (num_blocks() > keep) {
    pool_.Release(blocks_.back(), layout_.block_bytes());
    blocks_.pop_back();
  }
}

}  // namespace mha
