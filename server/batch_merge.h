// Packing several decoded requests into one ragged engine batch (back to
// back, no padding) and cutting the results apart again.
#ifndef MHA_SERVER_BATCH_MERGE_H_
#define MHA_SERVER_BATCH_MERGE_H_

#include <cstdint>
#include <vector>

#include "engine/attention_batch.h"
#include "server/request_codec.h"

namespace mha::server {

// Whether two requests can share one engine call: same kind of attention
// and the same batch-wide flags.
struct BatchSignature {
  bool self_attention = false;
  bool value_is_key = false;
  bool is_causal = false;
  bool has_attn_mask = false;
  bool attn_mask_per_head = false;
  bool need_weights = false;
  bool per_head_weights = false;

  static BatchSignature Of(const DecodedRequest& r);
  bool operator==(const BatchSignature&) const = default;
};

// Owns the merged inputs (copies; masks as additive f32) and the ragged
// batch that borrows them; a batch of one request borrows that request's
// inputs instead (no copy), so the request must outlive it. Requests must
// share a signature. Not copyable.
class MergedBatch {
 public:
  MergedBatch(const std::vector<const DecodedRequest*>& requests, int64_t num_heads);
  MergedBatch(const MergedBatch&) = delete;
  MergedBatch& operator=(const MergedBatch&) = delete;

  const AttentionBatch& batch() const { return batch_; }
  // Where request i's rows start in the output and its weights in the
  // weights output (elements).
  int64_t output_row(size_t i) const { return output_rows_[i]; }
  int64_t weights_offset(size_t i) const { return weights_offsets_[i]; }
  int64_t total_weights() const { return weights_offsets_.back(); }

 private:
  std::vector<float> query_, key_, value_, key_padding_, attn_mask_;
  std::vector<int64_t> output_rows_, weights_offsets_;
  AttentionBatch batch_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_BATCH_MERGE_H_
