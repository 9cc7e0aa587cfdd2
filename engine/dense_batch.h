// PyTorch-shaped (batch_first) input tensors turned into an AttentionBatch:
// query [B, L, E] or [L, E], key [B, S, kdim], value [B, S, vdim],
// key_padding_mask [B, S], attn_mask [L, S] or [B * num_heads, L, S].
#ifndef MHA_ENGINE_DENSE_BATCH_H_
#define MHA_ENGINE_DENSE_BATCH_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_batch.h"
#include "engine/model_config.h"
#include "engine/tensor.h"

namespace mha {

struct DenseInputs {
  Tensor query;
  std::optional<Tensor> key, value, key_padding_mask, attn_mask;
  bool is_causal = false;
};

// Owns the inputs (as f32, masks as BOOL or F32) and an AttentionBatch that
// borrows them. Movable, not copyable; thread-compatible.
class DenseBatch {
 public:
  // Checks every shape and dtype against `dims`; INVALID_ARGUMENT names the
  // tensor and what was expected, e.g. "query: expected last dimension 512,
  // got 511".
  static absl::StatusOr<DenseBatch> Create(const AttentionDims& dims,
                                           DenseInputs inputs);

  const AttentionBatch& batch() const { return batch_; }
  // Shapes of the outputs, unbatched inputs giving unbatched outputs.
  std::vector<int64_t> OutputShape() const;
  std::vector<int64_t> WeightsShape(bool per_head) const;

  DenseBatch(DenseBatch&&) = default;
  DenseBatch& operator=(DenseBatch&&) = default;

 private:
  DenseBatch() = default;
  absl::Status CheckShapes(const AttentionDims& dims);
  void Bind(const AttentionDims& dims);

  DenseInputs in_;
  bool batched_ = true;
  int64_t batch_size_ = 0, q_len_ = 0, kv_len_ = 0;
  int64_t embed_dim_ = 0, num_heads_ = 0, extra_keys_ = 0;
  AttentionBatch batch_;
};

}  // namespace mha

#endif  // MHA_ENGINE_DENSE_BATCH_H_
