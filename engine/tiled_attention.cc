#include "engine/tiled_attention.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "engine/ops/avx512_kernels.h"
#include "engine/ops/flash_bf16.h"
#include "engine/threads.h"

namespace mha {

using onednn::dt;

TiledAttention::TiledAttention(int64_t qk_head_dim, int64_t v_head_dim, dt act_dt, float scale,
                               int64_t tile_keys, bool one_pass, MatmulCache* matmuls)
    : dqk_(qk_head_dim),
      dv_(v_head_dim),
      act_dt_(act_dt),
      scale_(scale),
      tile_keys_(std::max<int64_t>(1, tile_keys)),
      one_pass_(one_pass && act_dt == dt::bf16 && FlashBf16Fits(qk_head_dim, v_head_dim) &&
                !CpuHasAmx()),
      matmuls_(matmuls) {}

// scores [rows, cols] f32 = scale * q [rows, dqk] . k_tile [cols, dqk]^T
MatmulSpec TiledAttention::ScoresSpec(int64_t rows, int64_t cols) const {
  return AttentionScoresSpec(act_dt_, /*batch=*/0, rows, cols, dqk_, scale_);
}

// product [rows, dv] f32 = probs [rows, cols] . v_tile [cols, dv]
MatmulSpec TiledAttention::ContextSpec(int64_t rows, int64_t cols) const {
  return AttentionContextSpec(act_dt_, onednn::dt::f32, /*batch=*/0, rows, cols, dv_);
}

bool TiledAttention::UsesFlashBf16() const {
  // The kernel level at each call: tests cap it.
  return one_pass_ && ActiveKernelIsa() == KernelIsa::kAvx512Bf16;
}

void TiledAttention::Prepare(int64_t rows) const {
  if (UsesFlashBf16()) return;  // no oneDNN product
  matmuls_->Get(ScoresSpec(rows, tile_keys_));
  matmuls_->Get(ContextSpec(rows, tile_keys_));
}

void TiledAttention::RunFlashBf16(const TiledBlock& b, Workspace& ws) const {
  FlashBf16Block block;
  block.q = reinterpret_cast<const uint16_t*>(b.q);
  block.k = reinterpret_cast<const uint16_t*>(b.k);
  block.v = reinterpret_cast<const uint16_t*>(b.v);
  block.context = reinterpret_cast<uint16_t*>(b.context);
  block.rows = b.rows;
  block.keys = b.keys;
  block.dqk = dqk_;
  block.dv = dv_;
  block.q_stride = b.q_stride;
  block.k_stride = b.k_stride;
  block.v_stride = b.v_stride;
  block.scale = scale_;
  block.masks = b.masks;
  FlashBf16Scratch scratch;
  const int64_t q_words = b.q_stride > 0 ? b.rows * dqk_ / 2 : 0;  // dqk is even
  scratch.key_pairs =
      ws.Get<uint32_t>(Workspace::kTilePairs, kFlashBf16TileKeys * (dqk_ / 2 + dv_ / 2) + q_words);
  scratch.value_pairs = scratch.key_pairs + kFlashBf16TileKeys * (dqk_ / 2);
  if (q_words > 0) {
    scratch.q = reinterpret_cast<uint16_t*>(scratch.value_pairs + kFlashBf16TileKeys / 2 * dv_);
  }
  scratch.acc = ws.Get<float>(Workspace::kTileAcc, b.rows * dv_);
  scratch.max = ws.Get<float>(Workspace::kTileStats, 2 * b.rows);
  scratch.sum = scratch.max + b.rows;
  FlashAttentionBf16(block, scratch);
}

void TiledAttention::Run(const TiledBlock& b, Workspace& ws) const {
  if (UsesFlashBf16()) return RunFlashBf16(b, ws);
  const int64_t rows = b.rows, act = act_dt_ == dt::bf16 ? 2 : 4;
  const int64_t tile = std::min(tile_keys_, b.keys);
  float* scores = ws.Get<float>(Workspace::kScores, rows * tile);
  uint16_t* probs_bf16 =
      act_dt_ == dt::bf16 ? ws.Get<uint16_t>(Workspace::kProbsBf16, rows * tile) : nullptr;
  float* acc = ws.Get<float>(Workspace::kTileAcc, rows * dv_);
  float* product = ws.Get<float>(Workspace::kTileProduct, rows * dv_);
  float* stats = ws.Get<float>(Workspace::kTileStats, 3 * rows);
  const OnlineSoftmaxRows state{stats, stats + rows, stats + 2 * rows};
  std::fill_n(state.max, rows, -std::numeric_limits<float>::infinity());
  std::fill_n(state.sum, rows, 0.0f);
  bool first = true;
  for (int64_t col0 = 0; col0 < b.keys; col0 += tile) {
    const int64_t cols = std::min(tile, b.keys - col0);
    if (CausalMaskHides(b.masks, 0, b.rows, col0, cols)) continue;
    ExecuteMatmul(*matmuls_->Get(ScoresSpec(rows, cols)), ws, b.q, b.k + col0 * dqk_ * act, nullptr,
                  scores);
    OnlineSoftmaxTile(scores, rows, cols, col0, b.masks, state, probs_bf16);
    const void* probs = probs_bf16 == nullptr ? static_cast<const void*>(scores) : probs_bf16;
    // The first tile's product is the accumulator (no copy of it).
    ExecuteMatmul(*matmuls_->Get(ContextSpec(rows, cols)), ws, probs, b.v + col0 * dv_ * act,
                  nullptr, first ? acc : product);
    if (!first) RescaleAccumulate(acc, product, state.rescale, rows, dv_);
    first = false;
  }
  if (first) std::memset(acc, 0, sizeof(float) * rows * dv_);  // no tile seen
  NormalizeRows(acc, state.sum, rows, dv_, act_dt_ == dt::bf16, b.context);
}

}  // namespace mha
