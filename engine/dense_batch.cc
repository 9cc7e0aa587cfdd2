#include "engine/dense_batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace mha {
namespace {

// Floating tensors become F32; BOOL stays BOOL (masks only).
absl::Status Normalize(Tensor& t, const char* name, bool bool_ok) {
  if (t.dtype() == DType::kBool) {
    if (bool_ok) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": dtype BOOL, expected a floating type"));
  }
  if (t.dtype() != DType::kF32) t = MakeF32Tensor(t.shape(), ToFloatVector(t));
  return absl::OkStatus();
}

absl::Status ExpectShape(const Tensor& t, const char* name,
                         const std::vector<int64_t>& expected) {
  if (t.shape() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected shape ", ShapeString(expected), ", got ",
        ShapeString(t.shape())));
  }
  return absl::OkStatus();
}

absl::Status ExpectLastDim(const Tensor& t, const char* name, int rank,
                           int64_t last) {
  if (t.rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected rank ", rank, " (like the query), got shape ",
        ShapeString(t.shape())));
  }
  if (t.dim(rank - 1) != last) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected last dimension ", last, ", got ", t.dim(rank - 1)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DenseBatch> DenseBatch::Create(const AttentionDims& dims,
                                              DenseInputs inputs) {
  DenseBatch d;
  d.in_ = std::move(inputs);
  RETURN_IF_ERROR(d.CheckShapes(dims));
  d.Bind(dims);
  return d;
}

absl::Status DenseBatch::CheckShapes(const AttentionDims& dims) {
  Tensor& q = in_.query;
  if (q.rank() != 2 && q.rank() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: expected rank 3 [B, L, E] or 2 [L, E], got shape ",
        ShapeString(q.shape())));
  }
  RETURN_IF_ERROR(Normalize(q, "query", false));
  const int rank = q.rank();
  batched_ = rank == 3;
  RETURN_IF_ERROR(ExpectLastDim(q, "query", rank, dims.embed_dim));
  batch_size_ = batched_ ? q.dim(0) : 1;
  q_len_ = q.dim(rank - 2);
  if (batch_size_ == 0 || q_len_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: shape ", ShapeString(q.shape()), " has no tokens"));
  }
  kv_len_ = q_len_;
  if (!in_.key.has_value() && in_.value.has_value()) {
    return absl::InvalidArgumentError("value: given without key");
  }
  if (!in_.key.has_value() && (dims.kdim != dims.embed_dim || dims.vdim != dims.embed_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: required, this model has kdim ", dims.kdim, " and vdim ", dims.vdim,
        " but embed_dim ", dims.embed_dim, " (self-attention needs them equal)"));
  }
  if (in_.key.has_value() && !in_.value.has_value() && dims.kdim != dims.vdim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "value: required, this model has kdim ", dims.kdim, " != vdim ", dims.vdim));
  }
  if (in_.key.has_value()) {
    RETURN_IF_ERROR(Normalize(*in_.key, "key", false));
    RETURN_IF_ERROR(ExpectLastDim(*in_.key, "key", rank, dims.kdim));
    if (batched_ && in_.key->dim(0) != batch_size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key: expected batch size ", batch_size_, " (the query's), got ",
          in_.key->dim(0)));
    }
    kv_len_ = in_.key->dim(rank - 2);
    if (kv_len_ == 0) {  // an empty key would read as self-attention
      return absl::InvalidArgumentError(absl::StrCat(
          "key: shape ", ShapeString(in_.key->shape()), " has no tokens"));
    }
  }
  if (in_.value.has_value()) {
    RETURN_IF_ERROR(Normalize(*in_.value, "value", false));
    std::vector<int64_t> expected = in_.key->shape();
    expected.back() = dims.vdim;
    RETURN_IF_ERROR(ExpectShape(*in_.value, "value", expected));
  }
  if (in_.key_padding_mask.has_value()) {
    RETURN_IF_ERROR(Normalize(*in_.key_padding_mask, "key_padding_mask", true));
    RETURN_IF_ERROR(ExpectShape(*in_.key_padding_mask, "key_padding_mask",
                                batched_ ? std::vector<int64_t>{batch_size_, kv_len_}
                                         : std::vector<int64_t>{kv_len_}));
  }
  if (in_.attn_mask.has_value()) {
    Tensor& m = *in_.attn_mask;
    RETURN_IF_ERROR(Normalize(m, "attn_mask", true));
    const std::vector<int64_t> shared = {q_len_, kv_len_};
    const std::vector<int64_t> per_head = {batch_size_ * dims.num_heads, q_len_, kv_len_};
    if (m.shape() != shared && m.shape() != per_head) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attn_mask: expected shape ", ShapeString(shared), " or ",
          ShapeString(per_head), ", got ", ShapeString(m.shape())));
    }
  }
  return absl::OkStatus();
}

void DenseBatch::Bind(const AttentionDims& dims) {
  embed_dim_ = dims.embed_dim;
  num_heads_ = dims.num_heads;
  extra_keys_ = dims.extra_keys();
  auto span_of = [](const std::optional<Tensor>& t) {
    return t.has_value() ? absl::Span<const float>(t->f32(), t->num_elements())
                         : absl::Span<const float>();
  };
  auto mask_of = [](const std::optional<Tensor>& t) {
    MaskView m;
    if (t.has_value()) {
      m.dtype = t->dtype();
      m.data = t->raw();
      m.num_elements = t->num_elements();
    }
    return m;
  };
  batch_.query = absl::Span<const float>(in_.query.f32(), in_.query.num_elements());
  batch_.key = span_of(in_.key);
  batch_.value = span_of(in_.value);
  batch_.key_padding_mask = mask_of(in_.key_padding_mask);
  batch_.attn_mask = mask_of(in_.attn_mask);
  batch_.attn_mask_per_head = in_.attn_mask.has_value() && in_.attn_mask->rank() == 3;
  batch_.is_causal = in_.is_causal;
  SetUniformOffsets(batch_size_, q_len_, kv_len_, num_heads_, batch_);
}

std::vector<int64_t> DenseBatch::OutputShape() const { return in_.query.shape(); }

std::vector<int64_t> DenseBatch::WeightsShape(bool per_head) const {
  std::vector<int64_t> shape;
  if (batched_) shape.push_back(batch_size_);
  if (per_head) shape.push_back(num_heads_);
  shape.push_back(q_len_);
  shape.push_back(kv_len_ + extra_keys_);
  return shape;
}

}  // namespace mha
