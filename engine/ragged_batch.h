// Several requests as one engine call: their sequences back to back, never
// padded, and where each request's results are in the call's outputs.
#ifndef MHA_ENGINE_RAGGED_BATCH_H_
#define MHA_ENGINE_RAGGED_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/attention_request.h"

namespace mha {

// What requests must have in common to share one engine call: the kind of
// attention, the batch-wide flags, and their masks' dtypes, so that masks
// are concatenated as they are, never converted here. A request without a
// key padding mask counts as BOOL: it joins with zeros (nothing masked).
struct BatchSignature {
  AttentionKind kind = AttentionKind::kSelf;
  bool is_causal = false;
  DType key_padding_mask = DType::kBool;
  std::optional<DType> attn_mask;
  bool attn_mask_per_head = false;
  bool need_weights = false;
  bool per_head_weights = false;

  static BatchSignature Of(const AttentionRequest& request);
  bool operator==(const BatchSignature&) const = default;
};

// Owns the merged inputs and the AttentionBatch that borrows them. A batch
// of one request borrows that request's inputs instead (no copy), unless
// rows follow. The requests must share a signature and outlive the batch.
// Not copyable; thread-compatible.
class RaggedBatch {
 public:
  // `rows_after` (session steps' query rows, [n, embed_dim]) are copied
  // right after the requests' query rows, in the same buffer: the engine
  // then projects both in one product without copying them again.
  explicit RaggedBatch(absl::Span<const AttentionRequest* const> requests,
                       absl::Span<const float> rows_after = {});
  RaggedBatch(const RaggedBatch&) = delete;
  RaggedBatch& operator=(const RaggedBatch&) = delete;

  const AttentionBatch& batch() const { return batch_; }
  // The copy of `rows_after`, right after batch().query.
  absl::Span<const float> rows_after() const { return rows_after_; }
  bool per_head_weights() const { return per_head_weights_; }
  // Elements of the call's output ([total query rows, embed_dim]) and
  // attention weights (0 unless asked for).
  int64_t output_elements() const { return output_offsets_.back(); }
  int64_t weights_elements() const { return weights_offsets_.back(); }
  // Request i's part of the call's output and weights.
  absl::Span<const float> OutputOf(size_t i, absl::Span<const float> output) const;
  absl::Span<const float> WeightsOf(size_t i, absl::Span<const float> weights) const;

  // Bytes the batch copies of `request` when it is merged with others (its
  // inputs as f32 and its masks): what admission charges in advance.
  static int64_t MergedBytes(const AttentionRequest& request);

 private:
  std::vector<float> query_, key_, value_;
  std::vector<uint8_t> key_padding_, attn_mask_;  // in the requests' mask dtype
  std::vector<int64_t> output_offsets_, weights_offsets_;
  bool per_head_weights_ = false;
  AttentionBatch batch_;
  absl::Span<const float> rows_after_;
};

}  // namespace mha

#endif  // MHA_ENGINE_RAGGED_BATCH_H_
