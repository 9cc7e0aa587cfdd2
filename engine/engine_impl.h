// The engine's implementation behind MhaEngine: its weights, its two
// attention paths and the plan of a call. Internal to engine/ (compute.cc,
// mha_engine.cc, step_cache.cc, memory_estimate.cc, warm_up.cc);
// nothing outside the engine includes it.
#ifndef MHA_ENGINE_ENGINE_IMPL_H_
#define MHA_ENGINE_ENGINE_IMPL_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/mha_engine.h"
#include "engine/ops/kernels.h"
#include "engine/ops/linear_layer.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/packed_weights.h"
#include "engine/request_attention.h"
#include "engine/step_attention.h"
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
// does): owns the packed, reordered weights of one attention layer (its
// linear layers) and the two attention paths, RequestAttention for whole
// sequences and StepAttention for session steps. One call is planned from
// its shapes (PlanCall), projected in as few products as the plan allows
// (ProjectCall), attended on each path, and finished by one output product
// over all its rows. Immutable after construction; every method is const
// and thread-safe (concurrent calls need one Workspace each). Its methods
// may throw dnnl::error and std::bad_alloc: MhaEngine catches them at the
// engine's edge.
class EngineImpl {
 public:
  EngineImpl(const AttentionDims& dims, const PackedWeights& weights, const EngineOptions& options);

  // MhaEngine::Compute once validated (engine/compute.cc).
  void Compute(const AttentionBatch& attend, const StepBatch& steps, const MixedOutputs& out,
               Workspace& ws) const;
  int64_t WeightsElements(const AttentionBatch& batch, bool per_head) const;
  // Sessions (engine/step_cache.cc).
  KvLayout kv_layout() const;
  bool CanAppendSelf() const { return qkv_ != nullptr; }
  void ProjectEncoderMemory(absl::Span<const float> memory, absl::Span<const float> value,
                            int64_t len, const MaskView& key_padding, KvCache& cache,
                            Workspace& ws) const;
  // INVALID_ARGUMENT when `batch` and `out` do not fit each other or this
  // engine (ValidateBatch, and the weights' size).
  absl::Status ValidateRun(const AttentionBatch& batch, const AttentionOutputs& out) const;
  // INVALID_ARGUMENT when `batch`'s steps, caches or buffers do not fit this
  // engine (`output`: [step tokens, embed_dim]).
  absl::Status ValidateSteps(const StepBatch& batch, absl::Span<const float> output,
                             absl::Span<const float> weights) const;
  // Keys a step attends to after it (appended positions included), and the
  // weights elements of a whole batch of steps.
  int64_t AppendKeys(const CacheStep& step) const;
  int64_t StepWeightsElements(const StepBatch& batch) const;
  int64_t ScratchBytes(const BatchShape& shape, int threads) const;
  int64_t StepScratchBytes(int64_t tokens, int64_t keys, bool need_weights, int threads) const;
  uint64_t PrimitiveCacheMisses() const;
  // Warm-up's part that needs no lengths (RequestAttention's).
  void MakeRuntimePrimitives() const { sequences_->MakeRuntimePrimitives(); }
  int64_t WeightBytes() const;
  const AttentionDims& dims() const { return dims_; }

 private:
  struct CallPlan;
  struct StepRows;
  // The plan of one call, from its shapes: rows of each kind, and which
  // projection products run.
  CallPlan PlanCall(const AttentionBatch& attend, const StepBatch& steps) const;
  // Compute once planned, on the threads the calling thread has.
  void ComputePlanned(const CallPlan& plan, const AttentionBatch& attend, const StepBatch& steps,
                      const MixedOutputs& out, Workspace& ws) const;
  // Multiply-adds of an Attend-only call: its four projections and its
  // attention products.
  double AttendMacs(const AttentionBatch& attend) const;
  // The plan's projection products: the Attend rows' token-major q, k, v
  // into `t`, the steps' projected rows into `s`.
  void ProjectCall(const CallPlan& plan, const AttentionBatch& attend, const StepBatch& steps,
                   Workspace& ws, TokenMajor& t, StepRows& s) const;
  // The scratchpad slot's bytes for projecting `q_rows` query rows and
  // `kv_rows` cross key/value rows (0: self-attention or steps, whose keys
  // are their own rows), and the output product: the largest of the
  // layers' and the allowance; with int8 layers, their slots too.
  int64_t ProjectionScratchpad(int64_t q_rows, int64_t kv_rows) const;
  // What each of `threads` child workspaces holds for the int8 layers that
  // share the same rows out thread by thread (LinearLayer::Int8ThreadRows):
  // their slots and a scratchpad (0 when no layer does).
  int64_t Int8ChildBytes(int64_t q_rows, int64_t kv_rows, int threads) const;
  // `x` as the in-projections read it (in_dt_): itself in f32, else
  // converted into `slot`.
  const void* AsAct(absl::Span<const float> x, Workspace::Slot slot, Workspace& ws) const;
  TokenMajor ProjectTokens(const AttentionBatch& batch, Workspace& ws) const;
  // A cross-attention batch's keys and values into t.k and t.v.
  void ProjectKeysValues(const AttentionBatch& batch, Workspace& ws, TokenMajor& t) const;

  AttentionDims dims_;
  dnnl::engine engine_;
  onednn::dt act_dt_;  // f32, or bf16 for bf16 compute
  // What the q, k and v projections read: bf16 for bf16 compute with bf16
  // products; f32 otherwise (an int8 layer quantizes the request's f32).
  onednn::dt in_dt_;
  std::unique_ptr<LinearLayer> qkv_;  // self-attention: E -> q|k|v
  std::unique_ptr<LinearLayer> q_;    // cross-attention: E -> q
  std::unique_ptr<LinearLayer> kv_;   // key == value: kdim -> k|v
  std::unique_ptr<LinearLayer> k_, v_;
  std::unique_ptr<LinearLayer> out_;
  std::vector<float> norm_weight_, norm_bias_;
  bool choose_threads_;  // EngineOptions::choose_small_call_threads
  std::unique_ptr<const RequestAttention> sequences_;
  std::unique_ptr<const StepAttention> steps_;
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

}  // namespace mha

#endif  // MHA_ENGINE_ENGINE_IMPL_H_
