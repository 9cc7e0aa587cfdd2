// The attention of whole sequences (the Attend rows of an engine call), from
// their token-major q, k, v projections to the merged context: heads split
// out (with the bias_kv / zero_attn key positions), scores, masked softmax
// and context per block of sequences, rows and heads (oneDNN products, plain
// loops for small blocks, or key-tiled for long ones), merged back
// token-major. Internal to the engine (throws dnnl::error and
// std::bad_alloc; MhaEngine catches them).
#ifndef MHA_ENGINE_REQUEST_ATTENTION_H_
#define MHA_ENGINE_REQUEST_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "engine/attention_batch.h"
#include "engine/mha_engine.h"
#include "engine/ops/kernels.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/tiled_attention.h"
#include "engine/workspace.h"

namespace mha {

// Token-major projections as the linear layers wrote them.
struct TokenMajor {
  const uint8_t* q = nullptr;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  int64_t ldq = 0, ldk = 0, ldv = 0;  // row strides in elements
};

// Owns the attention products' oneDNN primitives (per shape and thread
// count) and a copy of the bias_kv rows. Immutable after construction apart
// from its primitive cache; thread-safe (one Workspace per concurrent call).
class RequestAttention {
 public:
  // `bias_k` / `bias_v`: one row each in the compute type (add_bias_kv).
  RequestAttention(const AttentionDims& dims, const EngineOptions& options, onednn::dt act_dt,
                   std::vector<uint8_t> bias_k, std::vector<uint8_t> bias_v);

  // Attention of every sequence of `batch` from `t` (out.weights written
  // when asked for; out.output is not touched). Returns the merged context,
  // token-major [rows, h * dv] in the compute type, in the workspace's
  // kProjQ slot sized for `context_rows` rows (>= the batch's query rows):
  // the rows after the batch's are the caller's. `t` may live in kProjQ: it
  // is read before the slot is reused.
  uint8_t* Attend(const TokenMajor& t, const AttentionBatch& batch, const AttentionOutputs& out,
                  int64_t context_rows, Workspace& ws) const;

  // How calls are cut (for the memory estimate): floats of scores one block
  // may hold; query rows per block of a sequence with `kv_len` keys (all of
  // them when they fit); heads per block of `rows` rows; whether a sequence
  // runs key-tiled, and the query rows per block of its head-major q and
  // context either way.
  int64_t ScoreCap() const;
  int64_t RowsPerBlock(int64_t q_len, int64_t kv_len) const;
  int64_t HeadsPerBlock(int64_t rows, int64_t kv_len) const;
  bool Tiled(int64_t q_len, int64_t kv_len, bool weights) const;
  int64_t QueryBlockRows(int64_t q_len, int64_t kv_len, bool weights) const;
  int64_t OnePassBlockRows(int64_t q_len) const;
  int64_t tile_keys() const { return options_.tile_keys; }
  // Whether key-tiled sequences run in one pass (engine/ops/flash_bf16.h),
  // with no oneDNN product and no score tile.
  bool TiledInOnePass() const;
  // Whether a sequence's queries, keys and values are read in place from
  // the token-major projections (one pass copies its block's query rows and
  // packs each key tile from there; no appended key positions): then they
  // are not split into heads.
  bool InPlace(int64_t q_len, int64_t kv_len, bool weights) const;

  // Creates the runtime-shape primitives (if used) for the calling thread's
  // count; the constructor does it for the constructing thread's, warm-up
  // for every count calls use.
  void MakeRuntimePrimitives() const;

  // Primitives its cache created (lookups that found none).
  uint64_t PrimitiveCacheMisses() const { return attention_matmuls_.misses(); }

 private:
  // The head-major buffers of a call's sequences, in the workspace.
  struct Projected {
    TokenMajor tokens;  // InPlace sequences read their q, k and v here
    uint8_t* q = nullptr;
    uint8_t* k = nullptr;
    uint8_t* v = nullptr;
    uint8_t* context_heads = nullptr;
    int64_t* kv_offsets = nullptr;  // B + 1 entries, in the workspace
    const float* key_padding = nullptr;
    const float* attn_mask = nullptr;
  };
  struct Block;
  // The token-major projections split into heads (with the appended key
  // positions) and the masks made additive.
  Projected Project(const TokenMajor& t, const AttentionBatch& batch, bool weights,
                    Workspace& ws) const;
  // Copies sequence b's token-major q, k, v into p's head-major buffers
  // (and appends the bias_kv / zero_attn positions).
  void SplitSequence(const TokenMajor& t, const AttentionBatch& batch, int64_t b, bool weights,
                     const Projected& p) const;
  // Attention of every sequence into p.context_heads (and out.weights).
  void AttendSequences(const Projected& p, const AttentionBatch& batch, const AttentionOutputs& out,
                       Workspace& ws) const;
  // p.context_heads merged back token-major into `context` [total_q, h*dv].
  void MergeContexts(const Projected& p, const AttentionBatch& batch, bool weights,
                     uint8_t* context) const;
  // Every sequence on the key-tiled path: their (row block, head) pairs
  // shared out among the threads, each on a child workspace
  // (request_attention_tiled.cc).
  struct TiledItems;
  struct TiledCursor;
  // Where each thread's run of items starts, and the end: inline up to 64
  // threads.
  using RunBounds = absl::InlinedVector<int64_t, 65>;
  static RunBounds DealItems(const TiledItems& items, TiledCursor c, int64_t first, int64_t end,
                             int64_t threads);
  void AttendTiled(const Projected& p, const AttentionBatch& batch, Workspace& ws) const;
  void AttendBlock(const Block& block, const Projected& p, const AttentionBatch& batch,
                   const AttentionOutputs& out, Workspace& ws) const;
  // The masks of sequence `seq` (q_len query rows) for the block starting
  // at query row `row0` and head `head0`.
  SoftmaxMasks MasksFor(const Projected& p, const AttentionBatch& batch, int64_t seq, int64_t q_len,
                        int64_t row0, int64_t head0) const;
  // Masks and softmax over a block's scores: into `probs_bf16` when not
  // null, and in place when `f32_probs` (see MaskedSoftmax).
  void Softmax(const Block& block, const Projected& p, const AttentionBatch& batch, float* scores,
               uint16_t* probs_bf16, bool f32_probs) const;
  // The two attention products of a block on oneDNN (scores f32; context in
  // the compute type).
  void AttentionScores(const Block& block, const uint8_t* q, const uint8_t* k, float* scores,
                       Workspace& ws) const;
  void AttentionContext(const Block& block, const void* probs, const uint8_t* v, uint8_t* context,
                        Workspace& ws) const;
  // Runs `spec` on the runtime-shape primitive when the block is small
  // enough, else on the cached per-shape one.
  void RunAttentionMatmul(const Block& block, const MatmulSpec& spec,
                          const std::optional<MatmulSpec>& runtime, const void* src,
                          const void* weights, void* dst, Workspace& ws) const;
  void WriteWeights(const Block& block, const float* probs, const AttentionOutputs& out) const;

  AttentionDims dims_;
  EngineOptions options_;
  onednn::dt act_dt_;                     // f32, or bf16 for bf16 compute
  std::vector<uint8_t> bias_k_, bias_v_;  // one row each, in act_dt_
  mutable MatmulCache attention_matmuls_;
  // The runtime-shape primitives for small blocks (see EngineOptions), made
  // by attention_matmuls_ (per thread count, as every primitive).
  std::optional<MatmulSpec> runtime_scores_, runtime_context_;
  std::unique_ptr<TiledAttention> tiled_;
};

}  // namespace mha

#endif  // MHA_ENGINE_REQUEST_ATTENTION_H_
