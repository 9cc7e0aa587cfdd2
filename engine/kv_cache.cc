#include "engine/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace mha {

void KvBlockPool::FreeAligned::operator()(uint8_t* p) const { std::free(p); }

uint8_t* KvBlockPool::Acquire(int64_t bytes) {
  MutexLock lock(mu_);
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
  MutexLock lock(mu_);
  in_use_ -= bytes;
  free_[bytes].emplace_back(block);
}

int64_t KvBlockPool::bytes_in_use() const {
  MutexLock lock(mu_);
  return in_use_;
}

int64_t KvBlockPool::bytes_held() const {
  MutexLock lock(mu_);
  return held_;
}

KvCache::~KvCache() = default;  // each block goes back with its last owner

KvCache::BlockPtr KvCache::NewBlock() {
  uint8_t* block = pool_.Acquire(layout_.block_bytes());
  if (block == nullptr) return nullptr;
  KvBlockPool* pool = &pool_;
  const int64_t bytes = layout_.block_bytes();
  try {
    return BlockPtr(block, [pool, bytes](uint8_t* b) { pool->Release(b, bytes); });
  } catch (const std::bad_alloc&) {  // the deleter ran
    return nullptr;
  }
}

absl::Status KvCache::UnshareLastBlock() {
  const int64_t used = length_ % KvLayout::kBlockTokens;
  const size_t last = static_cast<size_t>(length_ / KvLayout::kBlockTokens);
  if (used == 0 || last >= blocks_.size() || blocks_[last].use_count() == 1) {
    return absl::OkStatus();
  }
  BlockPtr copy = NewBlock();
  if (copy == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("session cache full: ", layout_.block_bytes(),
                                                     " more bytes needed to copy a shared "
                                                     "block, ",
                                                     pool_.bytes_in_use(), " of ", pool_.budget(),
                                                     " in use"));
  }
  // Only the valid tokens: another cache may be appending past them.
  CopyValidTokens(blocks_[last].get(), used, copy.get());
  blocks_[last] = std::move(copy);
  return absl::OkStatus();
}

void KvCache::CopyValidTokens(const uint8_t* from, int64_t used, uint8_t* to) const {
  const int64_t eb = layout_.elem_bytes, bt = KvLayout::kBlockTokens;
  const int64_t value_row = layout_.v_head_dim * eb;
  for (int64_t h = 0; h < layout_.heads; ++h) {
    for (int64_t c = 0; c < layout_.qk_head_dim; ++c) {  // keys: token index fastest
      const int64_t at = (h * layout_.qk_head_dim + c) * bt * eb;
      std::memcpy(to + at, from + at, static_cast<size_t>(used * eb));
    }
    const int64_t v = layout_.key_bytes() + h * bt * value_row;
    std::memcpy(to + v, from + v, static_cast<size_t>(used * value_row));
  }
  if (!layout_.int8()) return;
  for (int64_t row = 0; row < 2 * layout_.heads; ++row) {  // keys' then values' scales
    const int64_t at = layout_.key_bytes() + layout_.value_bytes() +
                       row * bt * static_cast<int64_t>(sizeof(float));
    std::memcpy(to + at, from + at, static_cast<size_t>(used) * sizeof(float));
  }
}

std::unique_ptr<KvCache> KvCache::Fork(int64_t length) const {
  auto fork = std::make_unique<KvCache>(layout_, pool_);
  const size_t shared = static_cast<size_t>(layout_.BlocksFor(length));
  fork->blocks_.assign(blocks_.begin(), blocks_.begin() + static_cast<ptrdiff_t>(shared));
  fork->length_ = length;
  fork->key_padding_ = key_padding_;
  return fork;
}

void KvCache::ReadBlock(int64_t block, uint8_t* out) const {
  const int64_t first = block * KvLayout::kBlockTokens;
  const int64_t valid = std::clamp<int64_t>(length_ - first, 0, KvLayout::kBlockTokens);
  const uint8_t* from = blocks_[static_cast<size_t>(block)].get();
  if (valid == KvLayout::kBlockTokens) {
    std::memcpy(out, from, static_cast<size_t>(layout_.block_bytes()));
    return;
  }
  std::memset(out, 0, static_cast<size_t>(layout_.block_bytes()));
  CopyValidTokens(from, valid, out);
}

void KvCache::WriteBlock(int64_t block, const uint8_t* in) {
  std::memcpy(blocks_[static_cast<size_t>(block)].get(), in,
              static_cast<size_t>(layout_.block_bytes()));
}

int64_t KvCache::BlocksToReserve(int64_t tokens) const {
  const int64_t fresh = std::max<int64_t>(0, layout_.BlocksFor(tokens) - num_blocks());
  const size_t last = static_cast<size_t>(length_ / KvLayout::kBlockTokens);
  const bool copy = tokens > length_ && length_ % KvLayout::kBlockTokens != 0 &&
                    last < blocks_.size() && blocks_[last].use_count() > 1;
  return fresh + (copy ? 1 : 0);
}

int64_t KvCache::exclusive_bytes() const {
  int64_t blocks = 0;
  for (const BlockPtr& b : blocks_) blocks += b.use_count() == 1 ? 1 : 0;
  return blocks * layout_.block_bytes();
}

absl::Status KvCache::Reserve(int64_t tokens) {
  if (tokens > length_) {
    if (absl::Status s = UnshareLastBlock(); !s.ok()) return s;
  }
  const int64_t had = num_blocks();
  const int64_t needed = layout_.BlocksFor(tokens);
  while (num_blocks() < needed) {
    BlockPtr block = NewBlock();
    if (block == nullptr) {
      blocks_.resize(static_cast<size_t>(had));
      return absl::ResourceExhaustedError(absl::StrCat(
          "session cache full: ", (needed - had) * layout_.block_bytes(), " more bytes needed, ",
          pool_.bytes_in_use(), " of ", pool_.budget(), " in use"));
    }
    blocks_.push_back(std::move(block));
  }
  return absl::OkStatus();
}

void KvCache::ReleaseUnused() {
  const int64_t keep = layout_.BlocksFor(length_);
  while (num_blocks() > keep) blocks_.pop_back();
}

}  // namespace mha
