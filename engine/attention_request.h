// One attention request as every front end decodes it, whatever its wire
// protocol: the kind stated explicitly, the inputs as views of the received
// bytes (used in place when they are aligned FP32, converted once
// otherwise), masks in their wire form, the flags and the output dtype.
#ifndef MHA_ENGINE_ATTENTION_REQUEST_H_
#define MHA_ENGINE_ATTENTION_REQUEST_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/attention_dims.h"
#include "engine/large_buffer.h"
#include "engine/tensor.h"

namespace mha {

// The bytes received for one tensor, little-endian in `dtype`, borrowed:
// they must outlive the AttentionRequest made from them (or be handed to
// it with KeepAlive).
// A message received in several buffers may hold a tensor in `pieces`
// instead (in order, `bytes` empty): it is gathered or converted once.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> bytes;
  std::vector<absl::Span<const uint8_t>> pieces;

  int64_t byte_size() const;
};

// A view of an owned tensor's bytes.
inline TensorView ViewOf(const Tensor& t) {
  return TensorView{t.dtype(), t.shape(), absl::MakeConstSpan(t.raw(), t.num_bytes()), {}};
}

// PyTorch's inputs (batch_first): query [B, L, E] or [L, E]; key
// [B, S, kdim] and value [B, S, vdim], of the query's rank;
// key_padding_mask [B, S] (or [S]); attn_mask [L, S] or [B * num_heads,
// L, S]. No key: self-attention; a key and no value: value = key.
struct RequestInputs {
  TensorView query;
  std::optional<TensorView> key, value, key_padding_mask, attn_mask;
  bool is_causal = false;
  bool need_weights = false;
  bool per_head_weights = false;
};

// A validated request: its inputs as one ragged batch of its B sequences
// (f32 spans over the received bytes or over the one converted copy it
// owns; masks BOOL or F32, as received) and what its response needs. Movable (the spans
// survive moves), not copyable; thread-compatible.
class AttentionRequest {
 public:
  // Checks every size, shape, dtype and value against `dims`: NaN or Inf
  // in query, key or value, and NaN or +inf in a float mask, are refused.
  // INVALID_ARGUMENT names the input and what was expected, with dtypes as
  // the front end spells them, e.g. "query: expected last dimension 512,
  // got 511". More than `max_tokens` query + key rows: RESOURCE_EXHAUSTED,
  // before anything is converted.
  static absl::StatusOr<AttentionRequest> Create(const AttentionDims& dims,
                                                 const RequestInputs& inputs, int64_t max_tokens,
                                                 DTypeSpelling spelling);

  AttentionRequest(AttentionRequest&&) = default;
  AttentionRequest& operator=(AttentionRequest&&) = default;

  AttentionKind kind() const { return batch_.kind; }
  const AttentionBatch& batch() const { return batch_; }
  bool need_weights() const { return need_weights_; }
  bool per_head_weights() const { return need_weights_ && per_head_weights_; }
  DType output_dtype() const { return output_dtype_; }  // the query's

  // Shapes of the results: the query's, and [B, (num_heads,) L, S'] with S'
  // counting the bias_kv / zero_attn positions (no B for an unbatched
  // query); the weights shape is empty unless need_weights.
  const std::vector<int64_t>& output_shape() const { return output_shape_; }
  const std::vector<int64_t>& weights_shape() const { return weights_shape_; }
  int64_t output_elements() const;
  int64_t weights_elements() const;

  int64_t rows() const { return batch_.num_rows(); }
  int64_t q_len() const { return q_len_; }
  int64_t kv_len() const { return kv_len_; }
  int64_t tokens() const { return tokens_; }                    // query + key rows
  int64_t wire_bytes() const { return wire_bytes_; }            // inputs as received
  int64_t converted_bytes() const { return converted_bytes_; }  // the copies it owns
  // The sizes the engine's scratch memory depends on.
  BatchShape shape() const;

  // Keeps `owner` (e.g. the storage the views point into) alive as long as
  // the request.
  void KeepAlive(std::shared_ptr<const void> owner) { keep_alive_.push_back(std::move(owner)); }

 private:
  AttentionRequest() = default;
  // The inputs as spans and masks, checked for non-finite values.
  absl::Status Bind(const RequestInputs& in);

  AttentionBatch batch_;
  // Converted or gathered copies (uninitialised until written: a fresh
  // page costs microseconds, and huge pages from 2 MiB on).
  LargeArray<float> query_, key_, value_, key_padding_, attn_mask_;
  LargeArray<uint8_t> bool_key_padding_, bool_attn_mask_;  // BOOL masks gathered from pieces
  std::vector<std::shared_ptr<const void>> keep_alive_;
  bool need_weights_ = false, per_head_weights_ = false;
  DType output_dtype_ = DType::kF32;
  std::vector<int64_t> output_shape_, weights_shape_;
  int64_t q_len_ = 0, kv_len_ = 0, tokens_ = 0, wire_bytes_ = 0, converted_bytes_ = 0;
};

}  // namespace mha

#endif  // MHA_ENGINE_ATTENTION_REQUEST_H_
