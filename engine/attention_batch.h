// What one engine call computes on: a ragged batch of sequences packed back
// to back (never padded), and where the results go.
#ifndef MHA_ENGINE_ATTENTION_BATCH_H_
#define MHA_ENGINE_ATTENTION_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_dims.h"
#include "engine/dtype.h"

namespace mha {

// A mask in one of the two PyTorch conventions: BOOL (one byte per element,
// nonzero = masked out) or F32 (added to the attention scores). Empty bytes
// mean no mask. Borrowed, not owned.
struct MaskView {
  DType dtype = DType::kBool;  // kBool or kF32
  const void* data = nullptr;  // nullptr: no mask
  int64_t num_elements = 0;    // elements readable at `data`

  bool present() const { return data != nullptr; }
};

// What the keys and values are: the query itself (self-attention), one key
// tensor serving as value too, or a key and a value of their own.
enum class AttentionKind { kSelf, kCrossValueIsKey, kCross };

// A ragged batch of B sequences. Sequence b owns query rows
// [q_offsets[b], q_offsets[b+1]) and key/value rows
// [kv_offsets[b], kv_offsets[b+1]). All pointers are borrowed for the call.
struct AttentionBatch {
  AttentionKind kind = AttentionKind::kSelf;
  absl::Span<const float> query;    // [total_q, embed_dim]
  absl::Span<const float> key;      // [total_kv, kdim]; empty for kSelf
  absl::Span<const float> value;    // [total_kv, vdim]; empty unless kCross
  std::vector<int64_t> q_offsets;   // B + 1 entries, from 0
  std::vector<int64_t> kv_offsets;  // B + 1 entries; ignored for kSelf

  // One entry per key row of the batch: [total_kv].
  MaskView key_padding_mask;
  // Per sequence b: a block [L_b, S_b] (or [num_heads, L_b, S_b] when
  // `attn_mask_per_head`) starting at element attn_mask_offsets[b]. A mask
  // shared by all sequences has every offset 0.
  MaskView attn_mask;
  bool attn_mask_per_head = false;
  std::vector<int64_t> attn_mask_offsets;
  // Query i of a sequence may not attend key j > i.
  bool is_causal = false;

  bool self_attention() const { return kind == AttentionKind::kSelf; }
  bool value_is_key() const { return kind == AttentionKind::kCrossValueIsKey; }
  int64_t num_rows() const {
    return q_offsets.empty() ? 0 : static_cast<int64_t>(q_offsets.size()) - 1;
  }
};

// Where Run writes. `output` is [total_q, embed_dim]. `weights`, when not
// empty, receives per sequence [L_b, S'_b] averaged over heads or
// [num_heads, L_b, S'_b] when `per_head_weights`, back to back; S'_b counts
// the appended bias_kv / zero_attn positions like PyTorch does.
struct AttentionOutputs {
  absl::Span<float> output;
  absl::Span<float> weights;
  bool per_head_weights = false;
};

// The sizes of a dense batch, all Run's memory depends on: `rows` rows (the
// request's B) of `q_len` query tokens and `kv_len` keys each
// (self-attention: kv_len = q_len).
struct BatchShape {
  int64_t rows = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  bool self_attention = true;
  bool value_is_key = true;        // cross-attention with no value of its own
  int64_t bool_mask_elements = 0;  // BOOL mask elements (Run makes them f32)
  bool need_weights = false;
};

// Describes a dense batch [B, L, *] / [B, S, *] as a ragged one, with masks
// shaped as in PyTorch: key_padding_mask [B, S], attn_mask [L, S] or, when
// `attn_mask_per_head` is already set, [B * num_heads, L, S]. Fills the
// offsets only; spans and masks are set by the caller.
void SetUniformOffsets(int64_t batch, int64_t q_len, int64_t kv_len, int64_t num_heads,
                       AttentionBatch& ragged);

// Checks that `batch` and `out` are consistent with each other and with
// `dims`: offsets, buffer sizes, mask dtypes and extents. INVALID_ARGUMENT
// names the field.
absl::Status ValidateBatch(const AttentionDims& dims, const AttentionBatch& batch,
                           const AttentionOutputs& out);

}  // namespace mha

#endif  // MHA_ENGINE_ATTENTION_BATCH_H_
