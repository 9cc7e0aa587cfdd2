// Server-side key/value caches of attention sessions: projected keys and
// values per head, in fixed-size blocks from one byte-budgeted pool, so a
// session grows without copying what it holds, and a fork shares its
// parent's blocks copy-on-write.
#ifndef MHA_ENGINE_KV_CACHE_H_
#define MHA_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "engine/mutex.h"

namespace mha {

// Where one model's keys and values sit in a block: for kBlockTokens tokens,
// keys [heads, qk_head_dim, kBlockTokens] (transposed: a step's scores are
// then broadcast-multiply-adds over the block's tokens, with no horizontal
// sums) then values [heads, kBlockTokens, v_head_dim], elements of
// `elem_bytes`: 4 (f32), 2 (bf16) or 1 (int8). An int8 block then holds
// the f32 scale of each token's key and value per head ([heads,
// kBlockTokens] for the keys, then the same for the values): element x
// stands for x * scale. Plain value type.
struct KvLayout {
  static constexpr int64_t kBlockTokens = 32;

  int64_t heads = 0, qk_head_dim = 0, v_head_dim = 0, elem_bytes = 4;

  bool int8() const { return elem_bytes == 1; }
  int64_t key_bytes() const { return heads * kBlockTokens * qk_head_dim * elem_bytes; }
  int64_t value_bytes() const { return heads * kBlockTokens * v_head_dim * elem_bytes; }
  int64_t scale_bytes() const {
    return int8() ? 2 * heads * kBlockTokens * static_cast<int64_t>(sizeof(float)) : 0;
  }
  int64_t block_bytes() const { return key_bytes() + value_bytes() + scale_bytes(); }
  int64_t BlocksFor(int64_t tokens) const { return (tokens + kBlockTokens - 1) / kBlockTokens; }
};

// Owns the memory of every cache block, under a byte budget: blocks in use
// and free blocks kept for reuse both count. Freed blocks are kept per size
// and handed out again, so steady-state sessions allocate nothing; a block of
// a new size first frees kept blocks of other sizes. Thread-safe.
class KvBlockPool {
 public:
  explicit KvBlockPool(int64_t budget_bytes) : budget_(budget_bytes) {}
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  // A block of `bytes` (64-byte aligned), or nullptr when the budget has no
  // room for it. Give it back with Release(block, bytes).
  uint8_t* Acquire(int64_t bytes);
  void Release(uint8_t* block, int64_t bytes);

  int64_t budget() const { return budget_; }
  // Bytes of blocks handed out and not yet released.
  int64_t bytes_in_use() const;
  // Bytes allocated: in use plus kept for reuse.
  int64_t bytes_held() const;

 private:
  struct FreeAligned {
    void operator()(uint8_t* p) const;
  };
  using Block = std::unique_ptr<uint8_t, FreeAligned>;

  const int64_t budget_;
  mutable Mutex mu_;
  absl::flat_hash_map<int64_t, std::vector<Block>> free_ ABSL_GUARDED_BY(mu_);  // by size
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

// One session's projected keys and values: `length()` tokens in blocks from
// a pool (borrowed; must outlive the cache), plus, for a cross-attention
// memory, its key padding as an additive f32 mask. Blocks are shared with
// forks: a block goes back to the pool when its last cache lets go. Tokens
// are only ever appended, so full blocks are never written again; the one
// partly filled last block is copied (its valid part) before a cache
// appends into it while another cache shares it. Not thread-safe: one
// caller at a time (the session's owner serialises its steps); Fork may
// run while the parent's step writes, since it reads nothing past
// `length`.
class KvCache {
 public:
  KvCache(const KvLayout& layout, KvBlockPool& pool) : layout_(layout), pool_(pool) {}
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvLayout& layout() const { return layout_; }
  int64_t length() const { return length_; }
  int64_t capacity() const { return num_blocks() * KvLayout::kBlockTokens; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Bytes of the blocks held.
  int64_t bytes() const { return num_blocks() * layout_.block_bytes(); }

  // Makes room for `tokens` tokens in all. RESOURCE_EXHAUSTED when the pool
  // cannot give the blocks; the cache then keeps only what it had.
  absl::Status Reserve(int64_t tokens);
  // Blocks Reserve(tokens) would take from the pool: new ones, plus a copy
  // of a shared, partly filled last block.
  int64_t BlocksToReserve(int64_t tokens) const;
  // Gives back the blocks beyond length().
  void ReleaseUnused();
  // A new cache of `length` tokens (at most length(), e.g. the length of
  // the last finished step) sharing this cache's blocks up to there, and
  // its key padding. Takes no block from the pool.
  std::unique_ptr<KvCache> Fork(int64_t length) const;
  // Bytes of the blocks no other cache shares: what dropping this cache
  // gives back to the pool.
  int64_t exclusive_bytes() const;
  // Block `block` as it travels (export, spill): block_bytes() bytes into
  // `out`, the valid tokens' keys and values, zeros past length().
  void ReadBlock(int64_t block, uint8_t* out) const;
  // Block `block`'s bytes from `in` (block_bytes() of them); the block must
  // be reserved and not shared.
  void WriteBlock(int64_t block, const uint8_t* in);
  // Set by the engine once it has written the keys and values up to `n`.
  void set_length(int64_t n) { length_ = n; }

  // Keys [qk_head_dim, kBlockTokens] (the token index fastest) and values
  // [kBlockTokens, v_head_dim] of `head` in block `block`.
  uint8_t* keys(int64_t block, int64_t head) const {
    return blocks_[static_cast<size_t>(block)].get() +
           head * KvLayout::kBlockTokens * layout_.qk_head_dim * layout_.elem_bytes;
  }
  uint8_t* values(int64_t block, int64_t head) const {
    return blocks_[static_cast<size_t>(block)].get() + layout_.key_bytes() +
           head * KvLayout::kBlockTokens * layout_.v_head_dim * layout_.elem_bytes;
  }
  // An int8 cache's scales of `head`'s keys and values in block `block`,
  // [kBlockTokens] each.
  float* key_scales(int64_t block, int64_t head) const {
    return reinterpret_cast<float*>(blocks_[static_cast<size_t>(block)].get() +
                                    layout_.key_bytes() + layout_.value_bytes()) +
           head * KvLayout::kBlockTokens;
  }
  float* value_scales(int64_t block, int64_t head) const {
    return key_scales(block, head) + layout_.heads * KvLayout::kBlockTokens;
  }

  // A cross-attention memory's key padding, additive ([length()] f32, 0 or
  // -inf); empty when it has none.
  const std::vector<float>& key_padding() const { return key_padding_; }
  void set_key_padding(std::vector<float> mask) { key_padding_ = std::move(mask); }

 private:
  using BlockPtr = std::shared_ptr<uint8_t>;  // released to the pool by the last owner
  // A block from the pool, or null when it has no room.
  BlockPtr NewBlock();
  // The first `used` tokens' keys and values of block `from` into `to`.
  void CopyValidTokens(const uint8_t* from, int64_t used, uint8_t* to) const;
  // Copies the partly filled last block before appending into it when
  // another cache shares it. RESOURCE_EXHAUSTED when the pool has no room.
  absl::Status UnshareLastBlock();

  const KvLayout layout_;
  KvBlockPool& pool_;
  std::vector<BlockPtr> blocks_;
  int64_t length_ = 0;
  std::vector<float> key_padding_;
};

}  // namespace mha

#endif  // MHA_ENGINE_KV_CACHE_H_
