// The engine's implementation behind MhaEngine: its oneDNN members and
// private helpers. Internal to engine/ (mha_engine.cc, memory_estimate.cc,
// warm_up.cc); nothing outside the engine includes it.
#ifndef MHA_ENGINE_ENGINE_IMPL_H_
#define MHA_ENGINE_ENGINE_IMPL_H_

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/ops/kernels.h"
#include "engine/mha_engine.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/tiled_attention.h"
#include "engine/packed_weights.h"
#include "engine/workspace.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

// Runs `call` at the engine's edge: oneDNN errors and exceptions become
// absl::Status (allocation failures RESOURCE_EXHAUSTED, the rest INTERNAL).
// A template, not std::function: a warm call allocates nothing.
absl::Status EngineErrorStatus(std::exception_ptr error);
template <typename Call>
absl::Status GuardEngineCall(Call&& call) {
  try {
    call();
  } catch (...) {
    return EngineErrorStatus(std::current_exception());
  }
  return absl::OkStatus();
}

// MhaEngine's implementation (see mha_engine.h for what each public method
// does): owns the packed, reordered weights of one attention layer and the
// oneDNN primitives built for it. Immutable after construction; every method
// is const and thread-safe (concurrent Run calls need one Workspace each).
// Its methods may throw dnnl::error and std::bad_alloc: MhaEngine catches
// them at the engine's edge.
class EngineImpl {
 public:
  EngineImpl(const AttentionDims& dims, const PackedWeights& weights,
             const EngineOptions& options);

  // MhaEngine::Compute once validated (engine/compute.cc).
  void Compute(const AttentionBatch& sequences, const AppendBatch& steps,
               const MixedOutputs& out, Workspace& ws) const;
  int64_t WeightsElements(const AttentionBatch& batch, bool per_head) const;
  // Sessions (engine/incremental_attention.cc).
  KvLayout kv_layout() const;
  bool CanAppendSelf() const { return qkv_ != nullptr; }
  void ProjectMemory(absl::Span<const float> memory, absl::Span<const float> value, int64_t len,
                     const MaskView& key_padding, KvCache& cache, Workspace& ws) const;
  // INVALID_ARGUMENT when `batch` and `out` do not fit each other or this
  // engine (ValidateBatch, and the weights' size).
  absl::Status ValidateRun(const AttentionBatch& batch, const AttentionOutputs& out) const;
  // INVALID_ARGUMENT when `batch`'s steps, caches or buffers do not fit this
  // engine (`output`: [step tokens, embed_dim]).
  absl::Status ValidateSteps(const AppendBatch& batch, absl::Span<const float> output,
                             absl::Span<const float> weights) const;
  // Keys a step attends to after it (appended positions included), and the
  // weights elements of a whole batch of steps.
  int64_t AppendKeys(const AppendStep& step) const;
  int64_t AppendWeightsElements(const AppendBatch& batch) const;
  int64_t ScratchBytes(const BatchShape& shape, int threads) const;
  int64_t StepScratchBytes(int64_t tokens, int64_t keys, bool need_weights, int threads) const;
  uint64_t PrimitiveCacheMisses() const;
  int64_t WeightBytes() const;
  const AttentionDims& dims() const { return dims_; }

 private:
  struct TokenMajor;
  struct CallPlan;
  struct StepRows;
  struct SessionHeads;
  struct Projected;
  struct Block;
  // Floats of scores one block may hold, and the query rows per block of a
  // sequence with `kv_len` keys (all of them when they fit).
  int64_t ScoreCap() const;
  // Scores one query-row chunk of a (session step, head) may hold.
  static constexpr int64_t kSessionScoreCap = int64_t{1} << 16;
  int64_t RowsPerBlock(int64_t q_len, int64_t kv_len) const;
  // Heads per block for blocks of `rows` query rows (all when they fit).
  int64_t HeadsPerBlock(int64_t rows, int64_t kv_len) const;
  // Whether a sequence runs key-tiled (see EngineOptions), and the query
  // rows per block of its head-major q and context either way.
  bool Tiled(int64_t q_len, int64_t kv_len, bool weights) const;
  int64_t QueryBlockRows(int64_t q_len, int64_t kv_len, bool weights) const;
  // The plan of one call, from its shapes: rows of each kind, and which
  // projection products run.
  CallPlan PlanCall(const AttentionBatch& sequences, const AppendBatch& steps) const;
  // The plan's projection products: the sequences' token-major q, k, v
  // into `t`, the steps' projected rows into `s`.
  void ProjectCall(const CallPlan& plan, const AttentionBatch& sequences,
                   const AppendBatch& steps, Workspace& ws, TokenMajor& t, StepRows& s) const;
  // `x` in the compute type: itself in f32, else converted into `slot`.
  const void* AsAct(absl::Span<const float> x, Workspace::Slot slot, Workspace& ws) const;
  TokenMajor ProjectTokens(const AttentionBatch& batch, Workspace& ws) const;
  // A cross-attention batch's keys and values into t.k and t.v.
  void ProjectKeysValues(const AttentionBatch& batch, Workspace& ws, TokenMajor& t) const;
  // The token-major projections split into heads (with the appended key
  // positions) and the masks made additive.
  Projected Project(const TokenMajor& t, const AttentionBatch& batch, bool weights,
                    Workspace& ws) const;
  // Attention of every sequence into p.context_heads (and out.weights).
  void AttendSequences(const Projected& p, const AttentionBatch& batch,
                       const AttentionOutputs& out, Workspace& ws) const;
  // p.context_heads merged back token-major into `context` [total_q, h*dv].
  void MergeContexts(const Projected& p, const AttentionBatch& batch, bool weights,
                     uint8_t* context) const;
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
                          const std::optional<MatmulSpec>& runtime, const void* src,
                          const void* weights, void* dst, Workspace& ws) const;
  // One (session step, group of heads) of ComputeAppend: scores over the
  // cache blocks, softmax, context into the step's token-major context rows.
  void AttendSessionHeads(const SessionHeads& item, Workspace& ws) const;
  // Heads per item of a batch of `steps` steps, one with `keys` keys: as
  // many as keep every thread busy (4 items a thread or more) and their
  // score rows within kSessionScoreCap, dividing num_heads. An item reads
  // each cache block's keys (and values) of its heads in one run.
  int64_t HeadsPerItem(int64_t steps, int64_t keys) const;
  // Scores of head `head`'s query row q against bias_k (add_bias_kv) and
  // the zero key (add_zero_attn), into extra[0], extra[1].
  void ScoreExtraKeys(int64_t head, const uint8_t* q, float* extra) const;
  // A context row of head `head` done: split order undone (`split`, a bf16
  // cache), bias_v's part added (its probability at extra_probs[0]), and
  // written to `out` in the compute dtype.
  void FinishContextRow(int64_t head, const float* extra_probs, bool split, float* acc,
                        uint8_t* out) const;
  // Every step of `batch` from its projected rows (`proj`, row stride `ldq`
  // elements: q, then k|v when any step is self): appends self steps' keys
  // and values to their caches, attends per (step, head), and writes the
  // context token-major into `context` [tokens, h*dv] and, when not empty,
  // the head-averaged weights.
  void AttendSteps(const AppendBatch& batch, const uint8_t* proj, int64_t ldq, uint8_t* context,
                   absl::Span<float> weights, Workspace& ws) const;
  // Copies `tokens` token-major keys and values (row strides in elements)
  // into `cache` from position `first` on (rounded to its dtype: bf16, or
  // int8 with a scale per row).
  void WriteCache(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv,
                  int64_t tokens, int64_t first, KvCache& cache) const;
  // The same for one head: k and v point at its columns. Heads touch
  // disjoint bytes of the cache, so they may be written concurrently.
  void WriteCacheHead(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv,
                      int64_t tokens, int64_t first, int64_t head, const KvCache& cache) const;
  void WriteWeights(const Block& block, const float* probs,
                    const AttentionOutputs& out) const;

  AttentionDims dims_;
  EngineOptions options_;
  dnnl::engine engine_;
  onednn::dt act_dt_;  // f32, or bf16 for bf16 compute
  std::unique_ptr<LinearLayer> qkv_;  // self-attention: E -> q|k|v
  std::unique_ptr<LinearLayer> q_;    // cross-attention: E -> q
  std::unique_ptr<LinearLayer> kv_;   // key == value: kdim -> k|v
  std::unique_ptr<LinearLayer> k_, v_;
  std::unique_ptr<LinearLayer> out_;
  std::vector<uint8_t> bias_k_, bias_v_;  // one row each, in act_dt_
  std::vector<float> norm_weight_, norm_bias_;
  mutable MatmulCache attention_matmuls_;
  // The runtime-shape primitives for small blocks (see EngineOptions), made
  // by attention_matmuls_ (per thread count, as every primitive).
  std::optional<MatmulSpec> runtime_scores_, runtime_context_;
  std::unique_ptr<TiledAttention> tiled_;
};

// q, k, v and the heads' outputs in head-major layout, act_dt_ elements:
// sequence b holds q [h, L_b, dqk] at element q_offsets[b] * h * dqk,
// k [h, S'_b, dqk] and v [h, S'_b, dv] at kv_offsets[b] (the offsets of the
// keys with the bias_kv / zero_attn positions appended, S'_b = S_b + extra),
// and context [h, L_b, dv] like q. Contiguous heads let oneDNN use its
// fastest (brgemm / AMX) kernels for the attention products.
struct EngineImpl::Projected {
  uint8_t* q = nullptr;
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  uint8_t* context_heads = nullptr;
  int64_t* kv_offsets = nullptr;  // B + 1 entries, in the workspace
  const float* key_padding = nullptr;
  const float* attn_mask = nullptr;
};

// What one call computes, decided from its shapes before any arithmetic:
// its sequences' query rows and its steps' tokens, and the projection
// products: one kind of row only (kSequences, kSteps); both in one product
// when one layer serves both (kJoint: q|k|v for self-attention sequences,
// q for cross ones beside cross steps only); or two (kSeparate: cross
// sequences beside self steps).
struct EngineImpl::CallPlan {
  enum Projection { kSequences, kSteps, kJoint, kSeparate };
  int64_t sequence_rows = 0;
  int64_t step_rows = 0;
  Projection projection = kSequences;
};

// The steps' projected rows (q, then k|v when any step is self): the first
// row, and the row stride in elements.
struct EngineImpl::StepRows {
  const uint8_t* proj = nullptr;
  int64_t ld = 0;
};

// Token-major projections as the linear layers wrote them.
struct EngineImpl::TokenMajor {
  const uint8_t* q = nullptr;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  int64_t ldq = 0, ldk = 0, ldv = 0;  // row strides in elements
};

}  // namespace mha

#endif  // MHA_ENGINE_ENGINE_IMPL_H_
