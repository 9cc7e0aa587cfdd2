// The attention of session steps (the step rows of an engine call) over
// their key/value caches: self steps' new keys and values written into their
// caches, then per (step, group of heads) the scores over the cache blocks,
// the masked softmax and the context, the items shared out among the
// threads, each block read in one run with the next ones fetched ahead.
// Internal to the engine (may throw std::bad_alloc; MhaEngine catches it).
#ifndef MHA_ENGINE_STEP_ATTENTION_H_
#define MHA_ENGINE_STEP_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "engine/attention_dims.h"
#include "engine/kv_cache.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/step_batch.h"
#include "engine/workspace.h"

namespace mha {

// Owns the dims, compute type and a copy of the bias_kv rows. Immutable;
// thread-safe (one Workspace per concurrent call; the steps' caches are the
// caller's, each in one call at a time).
class StepAttention {
 public:
  // Scores one query-row chunk of a (session step, group of heads) may hold.
  static constexpr int64_t kSessionScoreCap = int64_t{1} << 16;

  // `bias_k` / `bias_v`: one row each in the compute type (add_bias_kv).
  StepAttention(const AttentionDims& dims, onednn::dt act_dt, std::vector<uint8_t> bias_k,
                std::vector<uint8_t> bias_v);

  // Keys a step attends to after it (appended positions included).
  int64_t Keys(const CacheStep& step) const;

  // Every step of `batch` from its projected rows (`proj`, row stride `ldq`
  // elements: q, then k|v when any step is self): appends self steps' keys
  // and values to their caches, attends per (step, group of heads), and
  // writes the context token-major into `context` [tokens, h*dv] and, when
  // not empty, the head-averaged weights.
  void Attend(const StepBatch& batch, const uint8_t* proj, int64_t ldq, uint8_t* context,
              absl::Span<float> weights, Workspace& ws) const;

  // Copies `tokens` token-major keys and values (row strides in elements)
  // into `cache` from position `first` on (rounded to its dtype: bf16, or
  // int8 with a scale per row).
  void WriteCache(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv, int64_t tokens,
                  int64_t first, KvCache& cache) const;

 private:
  struct SessionHeads;
  // One (session step, group of heads): scores over the cache blocks,
  // softmax, context into the step's token-major context rows.
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
  // WriteCache for one head: k and v point at its columns. Heads touch
  // disjoint bytes of the cache, so they may be written concurrently.
  void WriteCacheHead(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv, int64_t tokens,
                      int64_t first, int64_t head, const KvCache& cache) const;

  AttentionDims dims_;
  onednn::dt act_dt_;                     // f32, or bf16 for bf16 compute
  std::vector<uint8_t> bias_k_, bias_v_;  // one row each, in act_dt_
};

}  // namespace mha

#endif  // MHA_ENGINE_STEP_ATTENTION_H_
