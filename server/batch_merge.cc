#include "server/batch_merge.h"

#include <limits>

namespace mha::server {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void AppendAdditive(const MaskView& m, int64_t count, std::vector<float>& out) {
  if (!m.present()) {  // no mask: nothing is masked
    out.insert(out.end(), count, 0.0f);
    return;
  }
  if (m.dtype == DType::kF32) {
    const auto* values = static_cast<const float*>(m.data);
    out.insert(out.end(), values, values + count);
    return;
  }
  const auto* bools = static_cast<const uint8_t*>(m.data);
  for (int64_t i = 0; i < count; ++i) out.push_back(bools[i] != 0 ? kNegInf : 0.0f);
}

template <typename T>
void Append(absl::Span<const T> from, std::vector<T>& to) {
  to.insert(to.end(), from.begin(), from.end());
}

// Sequence lengths of one request's batch appended as offsets.
void AppendOffsets(const std::vector<int64_t>& offsets, std::vector<int64_t>& merged) {
  const int64_t base = merged.back();
  for (size_t i = 1; i < offsets.size(); ++i) merged.push_back(base + offsets[i]);
}

// Elements of the attention weights the request asked for (0: none).
int64_t WeightsElements(const DecodedRequest& r) {
  if (!r.need_weights) return 0;
  int64_t n = 1;
  for (int64_t d : r.weights_shape) n *= d;
  return n;
}

}  // namespace

BatchSignature BatchSignature::Of(const DecodedRequest& r) {
  const AttentionBatch& b = r.batch.batch();
  return BatchSignature{.self_attention = b.self_attention(),
                        .value_is_key = b.value.empty(),
                        .is_causal = b.is_causal,
                        .has_attn_mask = b.attn_mask.present(),
                        .attn_mask_per_head = b.attn_mask_per_head,
                        .need_weights = r.need_weights,
                        .per_head_weights = r.need_weights && r.per_head_weights};
}

MergedBatch::MergedBatch(const std::vector<const DecodedRequest*>& requests, int64_t num_heads) {
  output_rows_.push_back(0);
  weights_offsets_.push_back(0);
  const AttentionBatch& first = requests.front()->batch.batch();
  if (requests.size() == 1) {  // nothing to merge: borrow the request's inputs
    batch_ = first;
    output_rows_.push_back(first.q_offsets.back());
    weights_offsets_.push_back(WeightsElements(*requests.front()));
    return;
  }
  bool any_key_padding = false;
  for (const DecodedRequest* r : requests) any_key_padding |= r->batch.batch().key_padding_mask.present();
  batch_.q_offsets = {0};
  batch_.kv_offsets = {0};
  for (const DecodedRequest* r : requests) {
    const AttentionBatch& b = r->batch.batch();
    const std::vector<int64_t>& kv = b.self_attention() ? b.q_offsets : b.kv_offsets;
    const int64_t total_kv = kv.back();
    if (b.attn_mask.present()) {
      const auto base = static_cast<int64_t>(attn_mask_.size());
      for (int64_t offset : b.attn_mask_offsets) batch_.attn_mask_offsets.push_back(base + offset);
      AppendAdditive(b.attn_mask, b.attn_mask.num_elements, attn_mask_);
    }
    if (any_key_padding) AppendAdditive(b.key_padding_mask, total_kv, key_padding_);
    Append(b.query, query_);
    Append(b.key, key_);
    Append(b.value, value_);
    AppendOffsets(b.q_offsets, batch_.q_offsets);
    AppendOffsets(kv, batch_.kv_offsets);
    output_rows_.push_back(batch_.q_offsets.back());
    weights_offsets_.push_back(weights_offsets_.back() + WeightsElements(*r));
  }
  (void)num_heads;
  batch_.query = query_;
  batch_.key = key_;
  batch_.value = value_;
  batch_.is_causal = first.is_causal;
  batch_.attn_mask_per_head = first.attn_mask_per_head;
  if (any_key_padding) {
    batch_.key_padding_mask = {DType::kF32, key_padding_.data(),
                               static_cast<int64_t>(key_padding_.size())};
  }
  if (first.attn_mask.present()) {
    batch_.attn_mask = {DType::kF32, attn_mask_.data(), static_cast<int64_t>(attn_mask_.size())};
  }
}

}  // namespace mha::server
