// The multi-head attention engine: what torch.nn.MultiheadAttention computes
// (batch_first, inference), on oneDNN, for ragged batches.
#ifndef MHA_ENGINE_MHA_ENGINE_H_
#define MHA_ENGINE_MHA_ENGINE_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_batch.h"
#include "engine/kernels.h"
#include "engine/model_config.h"
#include "engine/onednn_matmul.h"
#include "engine/tiled_attention.h"
#include "engine/weights.h"
#include "engine/workspace.h"

namespace mha {

// Tuning knobs; the defaults suit serving.
struct EngineOptions {
  // Scores of one attention block stay below this: longer sequences run in
  // blocks of query rows, so scratch memory is bounded whatever the length.
  int64_t max_score_bytes = int64_t{4} << 20;
  // Attention products of blocks with at most this many scores (heads x
  // query rows x keys) run on one oneDNN primitive with runtime shapes,
  // created with the engine; larger ones on a primitive per shape, created
  // at first use and cached. 0: always per shape. -1 (default): 4 x 128 x
  // 128 in fp32 (a lone small request), where both run equally fast once
  // warm but a new shape costs ~0.5 ms more per shape; 0 in bf16, where the
  // per-shape AMX kernels run faster warm (and cost ~5 ms to create). See
  // mha_bench --overhead.
  int64_t runtime_dims_max_scores = -1;
  // Sequences with at least this many keys (appended positions included)
  // and `tiled_min_rows` query rows run key-tiled with an online softmax
  // (flash-attention style) when no attention weights are asked for: each
  // block of `tile_rows` query rows of one head streams its keys
  // `tile_keys` at a time, so its scores stay in the core's L2 cache, and
  // the blocks are shared out among the threads. 0: never.
  int64_t tiled_min_keys = 512;
  int64_t tiled_min_rows = 64;
  int64_t tile_rows = 512;
  int64_t tile_keys = 512;
};

// Owns the packed, reordered weights of one attention layer and the oneDNN
// primitives built for it. Created once; after Create every method is const
// and thread-safe (concurrent Run calls need one Workspace each).
class MhaEngine {
 public:
  static absl::StatusOr<std::unique_ptr<MhaEngine>> Create(
      const AttentionDims& dims, const PackedWeights& weights,
      const EngineOptions& options = {});

  // A workspace for one caller of Run; reuse it across calls.
  std::unique_ptr<Workspace> NewWorkspace() const;

  // Computes attention for `batch` into `out`. INVALID_ARGUMENT names what
  // is inconsistent; oneDNN failures come back as INTERNAL.
  absl::Status Run(const AttentionBatch& batch, const AttentionOutputs& out,
                   Workspace& ws) const;

  // Elements Run writes into AttentionOutputs::weights for `batch`.
  int64_t WeightsElements(const AttentionBatch& batch, bool per_head) const;

  // An upper bound of the workspace bytes one Run over `shape` on `threads`
  // threads needs (engine/memory_estimate.cc), from the shape alone: what
  // admission control charges before a request takes any memory.
  int64_t ScratchBytes(const BatchShape& shape, int threads) const;
  // A workspace holding more than this after a call gives its buffers back
  // (Workspace::ReleaseIfAbove), so one large request does not pin memory.
  static constexpr size_t kWorkspaceKeepBytes = size_t{64} << 20;

  // Creates, for each length L, the primitives a lone request of L tokens
  // needs (self-attention, or cross-attention over L keys for a model with
  // kdim or vdim != embed_dim), so that they are not created on the
  // request path (bf16's take ~5 ms each). At load, before serving.
  absl::Status WarmUp(absl::Span<const int64_t> lengths) const;
  // oneDNN primitives created since Create because a cache had none for
  // the shape (including those WarmUp made).
  uint64_t PrimitiveCacheMisses() const;

  const AttentionDims& dims() const { return dims_; }

 private:
  struct TokenMajor;
  struct Projected;
  struct Block;
  MhaEngine(const AttentionDims& dims, const PackedWeights& weights,
            const EngineOptions& options);

  void Compute(const AttentionBatch& batch, const AttentionOutputs& out,
               Workspace& ws) const;
  // Floats of scores one block may hold, and the query rows per block of a
  // sequence with `kv_len` keys (all of them when they fit).
  int64_t ScoreCap() const;
  int64_t RowsPerBlock(int64_t q_len, int64_t kv_len) const;
  // Heads per block for blocks of `rows` query rows (all when they fit).
  int64_t HeadsPerBlock(int64_t rows, int64_t kv_len) const;
  // Whether a sequence runs key-tiled (see EngineOptions), and the query
  // rows per block of its head-major q and context either way.
  bool Tiled(int64_t q_len, int64_t kv_len, bool weights) const;
  int64_t QueryBlockRows(int64_t q_len, int64_t kv_len, bool weights) const;
  TokenMajor ProjectTokens(const AttentionBatch& batch, Workspace& ws) const;
  Projected Project(const AttentionBatch& batch, bool weights, Workspace& ws) const;
  // Copies sequence b's token-major q, k, v into p's head-major buffers
  // (and appends the bias_kv / zero_attn positions).
  void SplitSequence(const TokenMajor& t, const AttentionBatch& batch, int64_t b,
                     bool weights, const Projected& p) const;
  // Sequence b on the key-tiled path: its (row block, head) pairs shared out
  // among the threads, each on a child workspace.
  void AttendTiled(int64_t b, const Projected& p, const AttentionBatch& batch,
                   Workspace& ws) const;
  void Attend(const Block& block, const Projected& p, const AttentionBatch& batch,
              const AttentionOutputs& out, Workspace& ws) const;
  // 1 / sqrt(qk_head_dim).
  float Scale() const { return 1.0f / std::sqrt(static_cast<float>(dims_.qk_head_dim)); }
  // The masks of sequence `seq` (q_len query rows) for the block starting
  // at query row `row0` and head `head0`.
  SoftmaxMasks MasksFor(const Projected& p, const AttentionBatch& batch, int64_t seq,
                        int64_t q_len, int64_t row0, int64_t head0) const;
  // Masks and softmax over a block's scores: into `probs_bf16` when not
  // null, and in place when `f32_probs` (see MaskedSoftmax).
  void Softmax(const Block& block, const Projected& p, const AttentionBatch& batch,
               float* scores, uint16_t* probs_bf16, bool f32_probs) const;
  // The two attention products of a block on oneDNN (scores f32; context in
  // the compute type).
  void AttentionScores(const Block& block, const uint8_t* q, const uint8_t* k, float* scores,
                       Workspace& ws) const;
  void AttentionContext(const Block& block, const void* probs, const uint8_t* v,
                        uint8_t* context, Workspace& ws) const;
  // Runs `spec` on the runtime-shape primitive when the block is small
  // enough, else on the cached per-shape one.
  void RunAttentionMatmul(const Block& block, const MatmulSpec& spec,
                          const MatmulPrimitive* runtime, const void* src,
                          const void* weights, void* dst, Workspace& ws) const;
  void WriteWeights(const Block& block, const float* probs,
                    const AttentionOutputs& out) const;

  AttentionDims dims_;
  EngineOptions options_;
  dnnl::engine engine_;
  dt act_dt_;  // f32, or bf16 for bf16 compute
  std::unique_ptr<LinearLayer> qkv_;  // self-attention: E -> q|k|v
  std::unique_ptr<LinearLayer> q_;    // cross-attention: E -> q
  std::unique_ptr<LinearLayer> kv_;   // key == value: kdim -> k|v
  std::unique_ptr<LinearLayer> k_, v_;
  std::unique_ptr<LinearLayer> out_;
  std::vector<uint8_t> bias_k_, bias_v_;  // one row each, in act_dt_
  std::vector<float> norm_weight_, norm_bias_;
  mutable MatmulCache attention_matmuls_;
  // Runtime-shape primitives for small blocks (see EngineOptions).
  std::unique_ptr<MatmulPrimitive> runtime_scores_, runtime_context_;
  std::unique_ptr<TiledAttention> tiled_;
};

}  // namespace mha

#endif  // MHA_ENGINE_MHA_ENGINE_H_
