#include "engine/attention_batch.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace mha {
namespace {

absl::Status CheckOffsets(const std::vector<int64_t>& offsets, const char* name) {
  if (offsets.size() < 2 || offsets[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": need at least 2 offsets, the first 0"));
  }
  for (size_t i = 1; i < offsets.size(); ++i) {
    if (offsets[i] < offsets[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": offsets must not decrease (entry ", i, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSize(const char* name, size_t got, int64_t rows, int64_t width) {
  if (static_cast<int64_t>(got) != rows * width) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", rows, " x ", width, " = ",
                                                   rows * width, " elements, got ", got));
  }
  return absl::OkStatus();
}

absl::Status CheckMaskDtype(const MaskView& m, const char* name) {
  if (m.present() && m.dtype != DType::kBool && m.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a BOOL or F32 mask"));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyValue(const AttentionDims& dims, const AttentionBatch& batch) {
  if (batch.self_attention()) {
    if (!batch.key.empty() || !batch.value.empty()) {
      return absl::InvalidArgumentError("self-attention: key and value must be empty");
    }
    if (dims.kdim != dims.embed_dim || dims.vdim != dims.embed_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("self-attention needs kdim == vdim == embed_dim; this model has kdim ",
                       dims.kdim, ", vdim ", dims.vdim, ": pass key and value"));
    }
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckOffsets(batch.kv_offsets, "kv_offsets"));
  if (batch.kv_offsets.size() != batch.q_offsets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_offsets: expected ", batch.q_offsets.size(),
                                                   " entries (one more than ", "sequences), got ",
                                                   batch.kv_offsets.size()));
  }
  const int64_t total_kv = batch.kv_offsets.back();
  RETURN_IF_ERROR(CheckSize("key", batch.key.size(), total_kv, dims.kdim));
  if (batch.key.empty()) {
    return absl::InvalidArgumentError("cross-attention: key has no tokens");
  }
  if (batch.value_is_key()) {
    if (!batch.value.empty()) {
      return absl::InvalidArgumentError("cross-attention with value = key: value must be empty");
    }
    if (dims.kdim != dims.vdim) {
      return absl::InvalidArgumentError(
          absl::StrCat("value: required because kdim ", dims.kdim, " != vdim ", dims.vdim));
    }
    return absl::OkStatus();
  }
  return CheckSize("value", batch.value.size(), total_kv, dims.vdim);
}

absl::Status CheckAttnMask(const AttentionDims& dims, const AttentionBatch& batch) {
  const MaskView& m = batch.attn_mask;
  if (!m.present()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckMaskDtype(m, "attn_mask"));
  const int64_t n = batch.num_rows();
  if (static_cast<int64_t>(batch.attn_mask_offsets.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("attn_mask: expected ", n, " offsets, got ", batch.attn_mask_offsets.size()));
  }
  const std::vector<int64_t>& kv = batch.self_attention() ? batch.q_offsets : batch.kv_offsets;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t block = (batch.attn_mask_per_head ? dims.num_heads : 1) *
                          (batch.q_offsets[b + 1] - batch.q_offsets[b]) * (kv[b + 1] - kv[b]);
    const int64_t begin = batch.attn_mask_offsets[b];
    if (begin < 0 || begin > m.num_elements || block > m.num_elements - begin) {
      return absl::InvalidArgumentError(absl::StrCat("attn_mask: sequence ", b, " needs elements [",
                                                     begin, ", ", begin + block,
                                                     ") of a mask with ", m.num_elements));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void SetUniformOffsets(int64_t batch, int64_t q_len, int64_t kv_len, int64_t num_heads,
                       AttentionBatch& ragged) {
  ragged.q_offsets.resize(batch + 1);
  ragged.kv_offsets.resize(batch + 1);
  ragged.attn_mask_offsets.resize(batch);
  for (int64_t b = 0; b <= batch; ++b) {
    ragged.q_offsets[b] = b * q_len;
    ragged.kv_offsets[b] = b * kv_len;
    if (b < batch) {
      ragged.attn_mask_offsets[b] = ragged.attn_mask_per_head ? b * num_heads * q_len * kv_len : 0;
    }
  }
}

absl::Status ValidateBatch(const AttentionDims& dims, const AttentionBatch& batch,
                           const AttentionOutputs& out) {
  RETURN_IF_ERROR(CheckOffsets(batch.q_offsets, "q_offsets"));
  const int64_t total_q = batch.q_offsets.back();
  RETURN_IF_ERROR(CheckSize("query", batch.query.size(), total_q, dims.embed_dim));
  RETURN_IF_ERROR(CheckKeyValue(dims, batch));
  const int64_t total_kv = batch.self_attention() ? total_q : batch.kv_offsets.back();
  if (batch.key_padding_mask.present()) {
    RETURN_IF_ERROR(CheckMaskDtype(batch.key_padding_mask, "key_padding_mask"));
    if (batch.key_padding_mask.num_elements != total_kv) {
      return absl::InvalidArgumentError(absl::StrCat("key_padding_mask: expected ", total_kv,
                                                     " elements (one per key), got ",
                                                     batch.key_padding_mask.num_elements));
    }
  }
  RETURN_IF_ERROR(CheckAttnMask(dims, batch));
  RETURN_IF_ERROR(CheckSize("output", out.output.size(), total_q, dims.embed_dim));
  return absl::OkStatus();
}

}  // namespace mha
