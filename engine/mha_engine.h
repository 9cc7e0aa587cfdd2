// The multi-head attention engine: what torch.nn.MultiheadAttention computes
// (batch_first, inference), on oneDNN, for ragged batches.
#ifndef MHA_ENGINE_MHA_ENGINE_H_
#define MHA_ENGINE_MHA_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/attention_dims.h"
#include "engine/kv_cache.h"
#include "engine/ops/primitive_budget.h"
#include "engine/packed_weights.h"
#include "engine/step_batch.h"
#include "engine/workspace.h"

namespace mha {

// Tuning knobs; the defaults suit serving.
struct EngineOptions {
  // Scores of one attention block stay below this: longer sequences run in
  // blocks of query rows, so scratch memory is bounded whatever the length.
  int64_t max_score_bytes = int64_t{4} << 20;
  // Attention products of blocks with at most this many scores (heads x
  // query rows x keys) run on one oneDNN primitive with runtime shapes
  // (per thread count), created with the engine and at warm-up; larger ones on a primitive per
  // shape, created at first use and cached. 0: always per shape. -1 (default): 4 x 128 x 128 in
  // fp32 (a lone small request), where both run equally fast once warm but a new shape costs ~0.5
  // ms more per shape; 0 in bf16, where the per-shape AMX kernels run faster warm (and cost ~5 ms
  // to create). See mha_bench --overhead.
  int64_t runtime_dims_max_scores = -1;
  // Sequences with at least this many keys (appended positions included)
  // and `tiled_min_rows` query rows run key-tiled with an online softmax
  // (flash-attention style) when no attention weights are asked for: each
  // block of `tile_rows` query rows of one head streams its keys
  // `tile_keys` at a time, so its scores stay in the core's L2 cache, and
  // the blocks are shared out among the threads. 0: never.
  int64_t tiled_min_keys = 512;
  int64_t tiled_min_rows = 64;
  // bf16 on a CPU with AVX512-BF16 and no AMX runs key-tiled blocks in
  // one pass (engine/ops/flash_bf16.h: no score tile, no oneDNN product),
  // faster than the untiled path from short sequences on (with AMX,
  // oneDNN's products are faster). false: oneDNN's products always.
  bool one_pass = true;
  // In one pass, sequences of at least this many query rows run key-tiled
  // whatever their keys; 0: only where tiled_min_keys and tiled_min_rows say.
  int64_t one_pass_min_rows = 32;
  int64_t tile_rows = 512;
  int64_t tile_keys = 512;
  // A call whose workspace has a yield point (Workspace::set_between_blocks)
  // runs its key-tiled blocks in waves of at least this many flops a
  // thread (~1.5-2.5 ms on one core), yielding after each: smaller waves
  // cost a barrier each (one block a thread a wave cost 2 % at L = 1024).
  int64_t yield_wave_flops = int64_t{256} << 20;
  // Calls of Attend rows only, of at most ThreadChoice::kMaxMacs
  // multiply-adds, run on one thread or on all, whichever recent calls of
  // their type and size ran faster (engine/thread_choice.h): where waking a
  // second core costs microseconds, a small call is faster alone. Only in
  // a process whose CallThreadCounts include 1 (engine/threads.h; the
  // server's, with its default 2 workers), where warm-up made the
  // one-thread primitives. false: always all threads.
  bool choose_small_call_threads = true;
};

class EngineImpl;  // engine/engine_impl.h

// Owns the packed, reordered weights of one attention layer and the oneDNN
// primitives built for it (behind EngineImpl: this header shows no oneDNN).
// Created once; after Create every method is const and thread-safe
// (concurrent Run calls need one Workspace each).
class MhaEngine {
 public:
  static absl::StatusOr<std::unique_ptr<MhaEngine>> Create(const AttentionDims& dims,
                                                           const PackedWeights& weights,
                                                           const EngineOptions& options = {});
  ~MhaEngine();

  // A workspace for one caller of Run; reuse it across calls. Every engine
  // of the process runs on one oneDNN CPU engine, so one workspace serves
  // every model (a server worker keeps one for all of them).
  static std::unique_ptr<Workspace> NewWorkspace();
  // A workspace holding more than this after a call gives its buffers back
  // (ReleaseLargeWorkspace), so one large request does not pin memory.
  static constexpr size_t kWorkspaceKeepBytes = size_t{64} << 20;
  // What the primitive caches of every engine of the process may hold
  // together, for a server's memory reserve: they share one capacity
  // (engine/ops/primitive_budget.h), least recently used out first whatever
  // the model, at ~109 KiB per primitive measured (E = 256).
  static constexpr int64_t kPrimitiveCacheBytes =
      PrimitiveBudget::kDefaultCapacity * PrimitiveBudget::kBytesPerPrimitive;
  // What those caches hold now, at the same measured bytes per primitive
  // (an estimate: oneDNN does not report its JIT code's size). Thread-safe.
  static int64_t PrimitiveCacheBytesHeld() {
    return PrimitiveBudget::Get().held() * PrimitiveBudget::kBytesPerPrimitive;
  }
  // Frees `ws`'s buffers when it holds more than kWorkspaceKeepBytes;
  // returns whether it did.
  static bool ReleaseLargeWorkspace(Workspace& ws);

  // The one compute call: Attend rows (`attend`, a ragged batch)
  // and session steps (`steps`: incremental attention over key/value
  // caches), either of which may be empty (a default AttentionBatch has no
  // rows). One projection product over the query tokens of both (two
  // when the Attend rows are cross-attention and a step is self-attention,
  // which need different projections), attention per row and per session
  // (self steps' caches grow by their tokens), one output product.
  // `out.output` holds the Attend rows' tokens, then the steps'. INVALID_ARGUMENT
  // names what is inconsistent; oneDNN failures come back as INTERNAL,
  // allocation failures as RESOURCE_EXHAUSTED.
  absl::Status Compute(const AttentionBatch& attend, const StepBatch& steps,
                       const MixedOutputs& out, Workspace& ws) const;
  // Compute of Attend rows only (a batch without offsets is rejected here,
  // where Compute reads it as no Attend rows).
  absl::Status Run(const AttentionBatch& batch, const AttentionOutputs& out, Workspace& ws) const;
  // Compute of session steps only.
  absl::Status Step(const StepBatch& steps, const StepOutputs& out, Workspace& ws) const {
    return Compute({}, steps, {out.output, {}, false, out.weights}, ws);
  }

  // Sessions (incremental attention over a key/value cache).
  // How this engine lays out a cache block (KvCache needs it).
  KvLayout kv_layout() const;
  // Whether self-attention sessions are possible: kdim == vdim == embed_dim.
  bool CanAppendSelf() const;
  // Projects a cross-attention memory ([len, kdim]; `value` [len, vdim], or
  // empty when the memory is the value too, which needs kdim == vdim) into
  // `cache`'s keys and values: once, at the session's start. `cache` must be
  // empty with room for `len` tokens; `key_padding` (empty or [len], BOOL or
  // F32 as in Run) becomes its additive mask.
  absl::Status ProjectEncoderMemory(absl::Span<const float> memory, absl::Span<const float> value,
                                    int64_t len, const MaskView& key_padding, KvCache& cache,
                                    Workspace& ws) const;
  // Elements Append writes into StepOutputs::weights for `batch`.
  int64_t StepWeightsElements(const StepBatch& batch) const;

  // Elements Run writes into AttentionOutputs::weights for `batch`.
  int64_t WeightsElements(const AttentionBatch& batch, bool per_head) const;

  // An upper bound of the workspace bytes one Run over `shape` on `threads`
  // threads needs (engine/memory_estimate.cc), from the shape alone: what
  // admission control charges before a request takes any memory.
  int64_t ScratchBytes(const BatchShape& shape, int threads) const;
  // The same for one session step of `tokens` query rows over `keys` keys
  // (its position after the step plus the model's extra keys), alone or
  // riding in an Attend call: what admission charges a step.
  int64_t StepScratchBytes(int64_t tokens, int64_t keys, bool need_weights, int threads) const;

  // Creates, for each length L, the primitives a lone request of L tokens
  // needs (self-attention, or cross-attention over L keys for a model with
  // kdim or vdim != embed_dim), so that they are not created on the
  // request path (bf16's take ~5 ms each): for each of CallThreadCounts()
  // (engine/threads.h), or the calling thread's count when none are set.
  // At load, before serving.
  absl::Status WarmUp(absl::Span<const int64_t> lengths) const;
  // oneDNN primitives created since Create because a cache had none for
  // the shape (including those WarmUp made).
  uint64_t PrimitiveCacheMisses() const;
  // What the engine's packed weights hold (every layer it packed), for a
  // server's memory reserve.
  int64_t WeightBytes() const;

  // The dims the engine computes with: those it was created with, except
  // bf16 = false when this CPU cannot compute in bf16 (CpuCanComputeBf16).
  const AttentionDims& dims() const;

 private:
  absl::Status WarmUpOnThisThread(absl::Span<const int64_t> lengths) const;
  explicit MhaEngine(std::unique_ptr<const EngineImpl> impl);

  std::unique_ptr<const EngineImpl> impl_;
};

}  // namespace mha

#endif  // MHA_ENGINE_MHA_ENGINE_H_
