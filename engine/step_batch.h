// What one incremental engine call computes on: new query tokens of several
// sessions, each against its own key/value cache, and where results go.
#ifndef MHA_ENGINE_STEP_BATCH_H_
#define MHA_ENGINE_STEP_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "engine/kv_cache.h"

namespace mha {

// One session's step. A self-attention step appends its tokens' keys and
// values to `cache` (which must have room: KvCache::Reserve) and each token
// attends to every cached token and to the new ones up to itself. A cross
// step attends to the cache (a projected memory), not causal, and appends
// nothing.
struct CacheStep {
  KvCache* cache = nullptr;  // borrowed for the call; one step per cache
  int64_t tokens = 0;        // >= 1
  bool cross = false;
};

// Steps back to back: step i's tokens are the next `tokens` rows of `query`
// ([total tokens, embed_dim]). Borrowed for the call.
struct StepBatch {
  absl::Span<const float> query;
  std::vector<CacheStep> steps;
};

// Whether any step of `batch` appends (self-attention).
inline bool AnySelfStep(const StepBatch& batch) {
  for (const CacheStep& step : batch.steps) {
    if (!step.cross) return true;
  }
  return false;
}

// Where MhaEngine::Step writes: `output` [total tokens, embed_dim];
// `weights`, when not empty, per step [tokens, keys'] averaged over heads,
// back to back, keys' = the keys after the step plus the bias_kv / zero_attn
// positions (a self step's future positions get 0).
struct StepOutputs {
  absl::Span<float> output;
  absl::Span<float> weights;
};

// Where MhaEngine::Compute of Attend sequences and session steps writes:
// `output` [batch query rows + step tokens, embed_dim], the batch's rows
// first; `weights` and `per_head_weights` as AttentionOutputs' for the
// batch; `step_weights` as StepOutputs::weights for the steps.
struct MixedOutputs {
  absl::Span<float> output;
  absl::Span<float> weights;
  bool per_head_weights = false;
  absl::Span<float> step_weights;
};

}  // namespace mha

#endif  // MHA_ENGINE_STEP_BATCH_H_
