// Attention of one block of query rows of one head over a long key
// sequence, key tile by key tile with an online softmax (flash-attention
// style): a tile's scores stay in the core's cache, and no [rows, keys]
// score matrix is ever held. Internal to the engine (throws dnnl::error).
#ifndef MHA_ENGINE_TILED_ATTENTION_H_
#define MHA_ENGINE_TILED_ATTENTION_H_

#include <cstdint>

#include "engine/ops/kernels.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/workspace.h"

namespace mha {

// One (query-row block, head): q [rows, dqk], k [keys, dqk], v [keys, dv]
// and context [rows, dv] contiguous, in the compute type, except that in
// one pass (UsesFlashBf16) q, k and v rows may be q_stride / k_stride /
// v_stride elements apart (0: contiguous). `masks` as for MaskedSoftmax over the
// block's rows and all `keys` columns.
struct TiledBlock {
  const uint8_t* q = nullptr;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  uint8_t* context = nullptr;
  int64_t rows = 0, keys = 0;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  SoftmaxMasks masks;
};

// Holds the head sizes, compute type and tile width, and borrows the
// engine's primitive cache. Immutable; Run is thread-safe with one
// Workspace per concurrent caller. Meant to run single-threaded inside the
// caller's parallel region (oneDNN then uses the calling thread only).
class TiledAttention {
 public:
  // `one_pass`: whether bf16 blocks may run in one pass (UsesFlashBf16).
  TiledAttention(int64_t qk_head_dim, int64_t v_head_dim, onednn::dt act_dt, float scale,
                 int64_t tile_keys, bool one_pass, MatmulCache* matmuls);

  // Creates the primitives of a full tile of `rows` query rows (outside a
  // parallel region, so they are planned for the calling thread's pool).
  void Prepare(int64_t rows) const;
  void Run(const TiledBlock& block, Workspace& ws) const;
  // Whether blocks run in one pass: bf16 heads the kernel takes, on a CPU
  // with AVX512-BF16 and no AMX (engine/ops/flash_bf16.h); no oneDNN
  // product, no score tile.
  bool UsesFlashBf16() const;

 private:
  void RunFlashBf16(const TiledBlock& block, Workspace& ws) const;
  MatmulSpec ScoresSpec(int64_t rows, int64_t cols) const;
  MatmulSpec ContextSpec(int64_t rows, int64_t cols) const;

  int64_t dqk_, dv_;
  onednn::dt act_dt_;
  float scale_;
  int64_t tile_keys_;
  bool one_pass_;  // bf16 heads the kernel takes, no AMX, and asked for
  MatmulCache* matmuls_;
};

}  // namespace mha

#endif  // MHA_ENGINE_TILED_ATTENTION_H_
