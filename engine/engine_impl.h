// The engine's implementation behind MhaEngine: its oneDNN members and
// private helpers. Internal to engine/ (mha_engine.cc, memory_estimate.cc,
// warm_up.cc); nothing outside the engine includes it.
#ifndef MHA_ENGINE_ENGINE_IMPL_H_
#define MHA_ENGINE_ENGINE_IMPL_H_

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/kernels.h"
#include "engine/mha_engine.h"
#include "engine/onednn_matmul.h"
#include "engine/tiled_attention.h"
#include "engine/weights.h"
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

  std::unique_ptr<Workspace> NewWorkspace() const;
  void Compute(const AttentionBatch& batch, const AttentionOutputs& out,
               Workspace& ws) const;
  int64_t WeightsElements(const AttentionBatch& batch, bool per_head) const;
  // Sessions (engine/incremental_attention.cc).
  KvLayout kv_layout() const;
  bool CanAppendSelf() const { return qkv_ != nullptr; }
  void ProjectMemory(absl::Span<const float> memory, absl::Span<const float> value, int64_t len,
                     const MaskView& key_padding, KvCache& cache, Workspace& ws) const;
  void ComputeAppend(const AppendBatch& batch, const AppendOutputs& out, Workspace& ws) const;
  // Keys a step attends to after it (appended positions included).
  int64_t AppendKeys(const AppendStep& step) const;
  int64_t ScratchBytes(const BatchShape& shape, int threads) const;
  uint64_t PrimitiveCacheMisses() const;
  const AttentionDims& dims() const { return dims_; }

 private:
  struct TokenMajor;
  struct SessionHead;
  struct Projected;
  struct Block;
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
  // One (session step, head) of ComputeAppend: scores over the cache
  // blocks, softmax, context into the step's token-major context rows.
  void AttendSessionHead(const SessionHead& item, Workspace& ws) const;
  // Copies `tokens` token-major keys and values (row strides in elements)
  // into `cache` from position `first` on.
  void WriteCache(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv,
                  int64_t tokens, int64_t first, KvCache& cache) const;
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
  // Runtime-shape primitives for small blocks (see EngineOptions).
  std::unique_ptr<MatmulPrimitive> runtime_scores_, runtime_context_;
  std::unique_ptr<TiledAttention> tiled_;
};

}  // namespace mha

#endif  // MHA_ENGINE_ENGINE_IMPL_H_
