// Key-tiled attention of one (query-row block, head) in one pass with
// AVX512-BF16's pair dot product: scores, online softmax and the weighted
// sum of values per group of query rows, no score stored
// (engine/ops/flash_bf16_kernels.cc). Only when ActiveKernelIsa() ==
// kAvx512Bf16 and FlashBf16Fits(dqk, dv).
#ifndef MHA_ENGINE_OPS_FLASH_BF16_H_
#define MHA_ENGINE_OPS_FLASH_BF16_H_

#include <cstdint>

#include "engine/ops/kernels.h"

namespace mha {

// Keys a tile holds: one pass packs them into pairs, then every query row
// of the block meets them.
inline constexpr int64_t kFlashBf16TileKeys = 64;

// One (query-row block, head), all bf16: q [rows, dqk], k [keys, dqk] and
// v [keys, dv] with rows q_stride / k_stride / v_stride elements apart (0:
// contiguous), so that they can be read in place from token-major
// projections (q's rows are copied side by side once, each tile is packed
// once; the products read only those); context [rows, dv] contiguous,
// written. Scores are scale * q . k, `masks` as for OnlineSoftmaxTile over
// the block's rows.
struct FlashBf16Block {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  uint16_t* context = nullptr;
  int64_t rows = 0, keys = 0, dqk = 0, dv = 0;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  float scale = 1.0f;
  SoftmaxMasks masks;
};

// The caller's scratch: one tile's keys and values in pairs, per row its
// f32 accumulator and running max and sum, and q's rows side by side when
// they are apart.
struct FlashBf16Scratch {
  uint32_t* key_pairs = nullptr;    // [dqk / 2, 64]
  uint32_t* value_pairs = nullptr;  // [32, dv]
  float* acc = nullptr;             // [rows, dv]
  float* max = nullptr;             // [rows]
  float* sum = nullptr;             // [rows]
  uint16_t* q = nullptr;            // [rows, dqk] when q_stride is set
};

// Whether the kernel takes heads of these sizes: an even dqk (whole
// pairs) and dv a multiple of 16 (whole vectors).
bool FlashBf16Fits(int64_t dqk, int64_t dv);

// Writes b.context = softmax(masked scores) . v, each row's probabilities
// rounded to bf16 for the product (as the tiled path's oneDNN products
// take them), accumulated in f32 and rounded to bf16 at the end. A row
// with every key masked gets zeros; overflowed scores give NaN.
void FlashAttentionBf16(const FlashBf16Block& b, const FlashBf16Scratch& scratch);

}  // namespace mha

#endif  // MHA_ENGINE_OPS_FLASH_BF16_H_
