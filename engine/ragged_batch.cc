#include "engine/ragged_batch.h"

namespace mha {
namespace {

std::optional<DType> MaskDType(const MaskView& mask) {
  if (!mask.present()) return std::nullopt;
  return mask.dtype;
}

int64_t MaskBytes(const MaskView& mask) {
  return mask.present() ? mask.num_elements * static_cast<int64_t>(DTypeSize(mask.dtype)) : 0;
}

template <typename T>
void Append(absl::Span<const T> from, std::vector<T>& to) {
  to.insert(to.end(), from.begin(), from.end());
}

void AppendMask(const MaskView& mask, std::vector<uint8_t>& to) {
  if (!mask.present()) return;
  const auto* bytes = static_cast<const uint8_t*>(mask.data);
  to.insert(to.end(), bytes, bytes + MaskBytes(mask));
}

// A key padding mask for `keys` keys of a request that has none: zero bytes,
// false in BOOL and 0.0f in F32 alike (nothing masked).
void AppendNoPadding(int64_t keys, DType dtype, std::vector<uint8_t>& to) {
  to.insert(to.end(), keys * DTypeSize(dtype), 0);
}

// One request's offsets appended after those already in `merged`.
void AppendOffsets(const std::vector<int64_t>& offsets, std::vector<int64_t>& merged) {
  const int64_t base = merged.back();
  for (size_t i = 1; i < offsets.size(); ++i) merged.push_back(base + offsets[i]);
}

MaskView MergedMask(bool present, DType dtype, const std::vector<uint8_t>& bytes) {
  if (!present) return {};
  return {dtype, bytes.data(), static_cast<int64_t>(bytes.size() / DTypeSize(dtype))};
}

}  // namespace

BatchSignature BatchSignature::Of(const AttentionRequest& request) {
  const AttentionBatch& b = request.batch();
  return BatchSignature{.kind = b.kind,
                        .is_causal = b.is_causal,
                        .key_padding_mask = MaskDType(b.key_padding_mask).value_or(DType::kBool),
                        .attn_mask = MaskDType(b.attn_mask),
                        .attn_mask_per_head = b.attn_mask_per_head,
                        .need_weights = request.need_weights(),
                        .per_head_weights = request.per_head_weights()};
}

RaggedBatch::RaggedBatch(absl::Span<const AttentionRequest* const> requests,
                         absl::Span<const float> rows_after) {
  output_offsets_ = {0};
  weights_offsets_ = {0};
  for (const AttentionRequest* r : requests) {
    output_offsets_.push_back(output_offsets_.back() + r->output_elements());
    weights_offsets_.push_back(weights_offsets_.back() + r->weights_elements());
  }
  const AttentionBatch& first = requests.front()->batch();
  per_head_weights_ = requests.front()->per_head_weights();
  if (requests.size() == 1 && rows_after.empty()) {  // nothing to merge: borrow the inputs
    batch_ = first;
    return;
  }
  batch_.kind = first.kind;
  batch_.is_causal = first.is_causal;
  batch_.attn_mask_per_head = first.attn_mask_per_head;
  batch_.q_offsets = {0};
  batch_.kv_offsets = {0};
  bool any_key_padding = false;
  for (const AttentionRequest* r : requests) {
    any_key_padding |= r->batch().key_padding_mask.present();
  }
  const DType key_padding_dtype = BatchSignature::Of(*requests.front()).key_padding_mask;
  // Room for everything first: appending into growing vectors would copy
  // the rows again at each doubling (and map fresh pages each time).
  size_t query_size = rows_after.size(), key_size = 0, value_size = 0;
  for (const AttentionRequest* r : requests) {
    query_size += r->batch().query.size();
    key_size += r->batch().key.size();
    value_size += r->batch().value.size();
  }
  query_.reserve(query_size);
  key_.reserve(key_size);
  value_.reserve(value_size);
  for (const AttentionRequest* r : requests) {
    const AttentionBatch& b = r->batch();
    if (b.attn_mask.present()) {
      const auto base = static_cast<int64_t>(attn_mask_.size() / DTypeSize(b.attn_mask.dtype));
      for (int64_t offset : b.attn_mask_offsets) batch_.attn_mask_offsets.push_back(base + offset);
    }
    AppendMask(b.attn_mask, attn_mask_);
    if (b.key_padding_mask.present()) {
      AppendMask(b.key_padding_mask, key_padding_);
    } else if (any_key_padding) {
      const int64_t keys = (b.self_attention() ? b.q_offsets : b.kv_offsets).back();
      AppendNoPadding(keys, key_padding_dtype, key_padding_);
    }
    Append(b.query, query_);
    Append(b.key, key_);
    Append(b.value, value_);
    AppendOffsets(b.q_offsets, batch_.q_offsets);
    AppendOffsets(b.self_attention() ? b.q_offsets : b.kv_offsets, batch_.kv_offsets);
  }
  const size_t request_rows = query_.size();
  Append(rows_after, query_);  // no span into query_ before this
  batch_.query = absl::MakeConstSpan(query_).first(request_rows);
  rows_after_ = absl::MakeConstSpan(query_).subspan(request_rows);
  batch_.key = key_;
  batch_.value = value_;
  batch_.key_padding_mask = MergedMask(any_key_padding, key_padding_dtype, key_padding_);
  batch_.attn_mask = MergedMask(first.attn_mask.present(), first.attn_mask.dtype, attn_mask_);
}

absl::Span<const float> RaggedBatch::OutputOf(size_t i, absl::Span<const float> output) const {
  return output.subspan(output_offsets_[i], output_offsets_[i + 1] - output_offsets_[i]);
}

absl::Span<const float> RaggedBatch::WeightsOf(size_t i, absl::Span<const float> weights) const {
  return weights.subspan(weights_offsets_[i], weights_offsets_[i + 1] - weights_offsets_[i]);
}

int64_t RaggedBatch::MergedBytes(const AttentionRequest& request) {
  const AttentionBatch& b = request.batch();
  return static_cast<int64_t>(b.query.size() + b.key.size() + b.value.size()) * 4 +
         MaskBytes(b.key_padding_mask) + MaskBytes(b.attn_mask);
}

}  // namespace mha
