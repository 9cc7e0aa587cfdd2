#include "engine/attention_request.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "engine/too_large.h"

namespace mha {
namespace {

static_assert(std::endian::native == std::endian::little,
              "wire bytes are used in place as little-endian floats");

constexpr int kMaxRank = 4;

int64_t Elements(const TensorView& v) {
  int64_t n = 1;
  for (int64_t d : v.shape) n *= d;
  return n;
}

int Rank(const TensorView& v) { return static_cast<int>(v.shape.size()); }

// The rank is 1 to 4, the element count fits int64 and the bytes are
// exactly the elements.
absl::Status CheckBytes(const TensorView& v, const char* field, DTypeSpelling spelling) {
  if (v.shape.empty() || Rank(v) > kMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected 1 to ", kMaxRank, " dimensions, got shape ", ShapeString(v.shape)));
  }
  const absl::StatusOr<int64_t> count = NumElements(v.shape);
  if (!count.ok())
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", count.status().message()));
  const uint64_t elem = DTypeSize(v.dtype);
  const uint64_t size = static_cast<uint64_t>(v.byte_size());
  if (static_cast<uint64_t>(*count) > size / elem || static_cast<uint64_t>(*count) * elem != size) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", size, " bytes, expected ",
                                                   absl::StrJoin(v.shape, " x "), " x ", elem,
                                                   " bytes (", DTypeName(v.dtype, spelling), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckFloating(const TensorView& v, const char* field, DTypeSpelling spelling) {
  if (v.dtype != DType::kBool) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(v.dtype, spelling),
                                                 ", expected ", DTypeName(DType::kF32, spelling),
                                                 ", ", DTypeName(DType::kBF16, spelling), " or ",
                                                 DTypeName(DType::kF16, spelling)));
}

// Masks come as PyTorch takes them: BOOL, or F32 added to the scores.
absl::Status CheckMaskDType(const TensorView& v, const char* field, DTypeSpelling spelling) {
  if (v.dtype == DType::kBool || v.dtype == DType::kF32) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(v.dtype, spelling),
                                                 ", expected ", DTypeName(DType::kBool, spelling),
                                                 " or ", DTypeName(DType::kF32, spelling)));
}

absl::Status ExpectShape(const TensorView& v, const char* field,
                         const std::vector<int64_t>& expected) {
  if (v.shape == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape ", ShapeString(expected),
                                                 ", got ", ShapeString(v.shape)));
}

absl::Status ExpectLastDim(const TensorView& v, const char* field, int rank, int64_t last) {
  if (Rank(v) != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected rank ", rank, " (like the query), got shape ", ShapeString(v.shape)));
  }
  if (v.shape.back() != last) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected last dimension ", last, ", got ", v.shape.back()));
  }
  return absl::OkStatus();
}

// The sizes every input must agree on.
struct Extents {
  bool batched = true;
  int64_t batch = 0, q_len = 0, kv_len = 0;
};

absl::StatusOr<Extents> CheckQuery(const AttentionDims& dims, const TensorView& q) {
  if (Rank(q) != 2 && Rank(q) != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: expected rank 3 [B, L, E] or 2 [L, E], got shape ", ShapeString(q.shape)));
  }
  RETURN_IF_ERROR(ExpectLastDim(q, "query", Rank(q), dims.embed_dim));
  Extents e;
  e.batched = Rank(q) == 3;
  e.batch = e.batched ? q.shape[0] : 1;
  e.q_len = q.shape[Rank(q) - 2];
  e.kv_len = e.q_len;
  if (e.batch == 0 || e.q_len == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("query: shape ", ShapeString(q.shape), " has no tokens"));
  }
  return e;
}

// Key and value against the query's extents; sets kv_len.
absl::Status CheckKeyValue(const AttentionDims& dims, const RequestInputs& in, Extents& e) {
  if (!in.key.has_value()) {
    if (in.value.has_value()) return absl::InvalidArgumentError("value: given without key");
    if (dims.kdim != dims.embed_dim || dims.vdim != dims.embed_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("key: required, this model has kdim ", dims.kdim, " and vdim ", dims.vdim,
                       " but embed_dim ", dims.embed_dim, " (self-attention needs them equal)"));
    }
    return absl::OkStatus();
  }
  if (!in.value.has_value() && dims.kdim != dims.vdim) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: required, this model has kdim ", dims.kdim, " != vdim ", dims.vdim));
  }
  const int rank = Rank(in.query);
  RETURN_IF_ERROR(ExpectLastDim(*in.key, "key", rank, dims.kdim));
  if (e.batched && in.key->shape[0] != e.batch) {
    return absl::InvalidArgumentError(absl::StrCat("key: expected batch size ", e.batch,
                                                   " (the query's), got ", in.key->shape[0]));
  }
  e.kv_len = in.key->shape[rank - 2];
  if (e.kv_len == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: shape ", ShapeString(in.key->shape), " has no tokens"));
  }
  if (!in.value.has_value()) return absl::OkStatus();
  std::vector<int64_t> expected = in.key->shape;
  expected.back() = dims.vdim;
  return ExpectShape(*in.value, "value", expected);
}

absl::Status CheckMasks(const AttentionDims& dims, const RequestInputs& in, const Extents& e) {
  if (in.key_padding_mask.has_value()) {
    RETURN_IF_ERROR(ExpectShape(
        *in.key_padding_mask, "key_padding_mask",
        e.batched ? std::vector<int64_t>{e.batch, e.kv_len} : std::vector<int64_t>{e.kv_len}));
  }
  if (in.attn_mask.has_value()) {
    const std::vector<int64_t> shared = {e.q_len, e.kv_len};
    const std::vector<int64_t> per_head = {e.batch * dims.num_heads, e.q_len, e.kv_len};
    if (in.attn_mask->shape != shared && in.attn_mask->shape != per_head) {
      return absl::InvalidArgumentError(
          absl::StrCat("attn_mask: expected shape ", ShapeString(shared), " or ",
                       ShapeString(per_head), ", got ", ShapeString(in.attn_mask->shape)));
    }
  }
  return absl::OkStatus();
}

// Elements converted and checked at a time: while they are in cache, the
// check for non-finite values costs no second read from memory.
constexpr int64_t kCheckChunk = 16384;

// f32 values written into a buffer piece by piece, checked for non-finite
// values a chunk at a time as they are written. Not thread-safe.
class CheckedWriter {
 public:
  explicit CheckedWriter(float* out) : out_(out) {}
  // Converts `n` elements of `dtype` at `bytes` to the end of what is
  // written.
  void Convert(DType dtype, const uint8_t* bytes, int64_t n) {
    const int64_t elem = DTypeSize(dtype);
    for (int64_t at = 0; at < n; at += kCheckChunk) {
      const int64_t k = std::min(kCheckChunk, n - at);
      ConvertToFloat(dtype, bytes + at * elem, k, out_ + done_);
      Check(k);
    }
  }
  int64_t first_non_finite() const { return first_non_finite_; }

 private:
  void Check(int64_t k) {
    if (first_non_finite_ < 0) {
      const int64_t i = FirstNonFinite({out_ + done_, static_cast<size_t>(k)});
      if (i >= 0) first_non_finite_ = done_ + i;
    }
    done_ += k;
  }

  float* const out_;
  int64_t done_ = 0, first_non_finite_ = -1;
};

// A view's values as f32, and the index of the first that is not finite
// (-1: none).
struct F32Values {
  absl::Span<const float> values;
  int64_t first_non_finite = -1;
};

// The view's values as f32: in place when they are aligned FP32 in one
// piece, else gathered or converted once into `copy` (an element may
// straddle two pieces), checked as they are written.
F32Values AsF32(const TensorView& v, LargeArray<float>& copy) {
  const int64_t n = Elements(v);
  if (v.pieces.empty() && v.dtype == DType::kF32 &&
      reinterpret_cast<uintptr_t>(v.bytes.data()) % alignof(float) == 0) {
    const absl::Span<const float> values(reinterpret_cast<const float*>(v.bytes.data()),
                                         static_cast<size_t>(n));
    return {values, FirstNonFinite(values)};
  }
  copy = LargeArray<float>(static_cast<size_t>(n));
  CheckedWriter out(copy.data());
  if (v.pieces.empty()) {
    out.Convert(v.dtype, v.bytes.data(), n);
    return {{copy.data(), copy.size()}, out.first_non_finite()};
  }
  const int64_t elem = DTypeSize(v.dtype);
  uint8_t straddler[8];
  int64_t held = 0;  // bytes of `straddler` filled
  for (absl::Span<const uint8_t> piece : v.pieces) {
    const uint8_t* p = piece.data();
    int64_t left = static_cast<int64_t>(piece.size());
    if (held > 0) {
      const int64_t more = std::min(elem - held, left);
      std::memcpy(straddler + held, p, static_cast<size_t>(more));
      held += more, p += more, left -= more;
      if (held < elem) continue;
      out.Convert(v.dtype, straddler, 1);
      held = 0;
    }
    const int64_t whole = left / elem;
    out.Convert(v.dtype, p, whole);
    held = left - whole * elem;
    std::memcpy(straddler, p + whole * elem, static_cast<size_t>(held));
  }
  return {{copy.data(), copy.size()}, out.first_non_finite()};
}

// The view's bytes in one piece: in place, or gathered into `copy`.
const uint8_t* Contiguous(const TensorView& v, LargeArray<uint8_t>& copy) {
  if (v.pieces.empty()) return v.bytes.data();
  copy = LargeArray<uint8_t>(static_cast<size_t>(v.byte_size()));
  uint8_t* out = copy.data();
  for (absl::Span<const uint8_t> piece : v.pieces) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
  return copy.data();
}

// NaN or Inf in query, key or value would come back as NaN outputs.
absl::StatusOr<absl::Span<const float>> FiniteInput(const TensorView& v, const char* field,
                                                    LargeArray<float>& copy) {
  const F32Values f32 = AsF32(v, copy);
  if (const int64_t i = f32.first_non_finite; i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": element ", i, " is ", f32.values[i], ", expected a finite number"));
  }
  return f32.values;
}

// BOOL masks are used as they are; F32 ones may hold -inf (masked out) but
// not NaN or +inf (copied only when unaligned).
absl::StatusOr<MaskView> Mask(const std::optional<TensorView>& v, const char* field,
                              LargeArray<float>& copy, LargeArray<uint8_t>& bool_copy) {
  if (!v.has_value()) return MaskView{};
  const int64_t n = Elements(*v);
  if (v->dtype == DType::kBool) return MaskView{DType::kBool, Contiguous(*v, bool_copy), n};
  const F32Values f32 = AsF32(*v, copy);
  const absl::Span<const float> values = f32.values;
  if (f32.first_non_finite >= 0) {
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(values[i]) || (values[i] > 0 && std::isinf(values[i]))) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": element ", i, " is ", values[i],
                                                       ", expected a finite number or -inf"));
      }
    }
  }
  return MaskView{DType::kF32, values.data(), n};
}

}  // namespace

absl::StatusOr<AttentionRequest> AttentionRequest::Create(const AttentionDims& dims,
                                                          const RequestInputs& in,
                                                          int64_t max_tokens,
                                                          DTypeSpelling spelling) {
  const std::pair<const char*, const TensorView*> views[] = {
      {"query", &in.query},
      {"key", in.key ? &*in.key : nullptr},
      {"value", in.value ? &*in.value : nullptr},
      {"key_padding_mask", in.key_padding_mask ? &*in.key_padding_mask : nullptr},
      {"attn_mask", in.attn_mask ? &*in.attn_mask : nullptr}};
  AttentionRequest r;
  for (const auto& [field, view] : views) {
    if (view == nullptr) continue;
    RETURN_IF_ERROR(CheckBytes(*view, field, spelling));
    RETURN_IF_ERROR(absl::EndsWith(field, "mask") ? CheckMaskDType(*view, field, spelling)
                                                  : CheckFloating(*view, field, spelling));
    r.wire_bytes_ += view->byte_size();
  }
  ASSIGN_OR_RETURN(Extents e, CheckQuery(dims, in.query));
  RETURN_IF_ERROR(CheckKeyValue(dims, in, e));
  RETURN_IF_ERROR(CheckMasks(dims, in, e));
  r.q_len_ = e.q_len;
  r.kv_len_ = e.kv_len;
  r.tokens_ = e.batch * (e.q_len + e.kv_len);
  if (r.tokens_ > max_tokens) {
    return TooLargeError(
        absl::StrCat("request has ", r.tokens_, " query + key tokens, the limit is ", max_tokens));
  }
  RETURN_IF_ERROR(r.Bind(in));
  SetUniformOffsets(e.batch, e.q_len, e.kv_len, dims.num_heads, r.batch_);
  r.output_dtype_ = in.query.dtype;
  r.output_shape_ = in.query.shape;
  r.need_weights_ = in.need_weights;
  r.per_head_weights_ = in.per_head_weights;
  if (r.need_weights_) {
    if (e.batched) r.weights_shape_.push_back(e.batch);
    if (in.per_head_weights) r.weights_shape_.push_back(dims.num_heads);
    r.weights_shape_.push_back(e.q_len);
    r.weights_shape_.push_back(e.kv_len + dims.extra_keys());
  }
  return r;
}

absl::Status AttentionRequest::Bind(const RequestInputs& in) {
  AttentionBatch& b = batch_;
  b.kind = !in.key.has_value()    ? AttentionKind::kSelf
           : in.value.has_value() ? AttentionKind::kCross
                                  : AttentionKind::kCrossValueIsKey;
  ASSIGN_OR_RETURN(b.query, FiniteInput(in.query, "query", query_));
  if (in.key.has_value()) {
    ASSIGN_OR_RETURN(b.key, FiniteInput(*in.key, "key", key_));
  }
  if (in.value.has_value()) {
    ASSIGN_OR_RETURN(b.value, FiniteInput(*in.value, "value", value_));
  }
  ASSIGN_OR_RETURN(b.key_padding_mask,
                   Mask(in.key_padding_mask, "key_padding_mask", key_padding_, bool_key_padding_));
  ASSIGN_OR_RETURN(b.attn_mask, Mask(in.attn_mask, "attn_mask", attn_mask_, bool_attn_mask_));
  b.attn_mask_per_head = in.attn_mask.has_value() && Rank(*in.attn_mask) == 3;
  b.is_causal = in.is_causal;
  for (const LargeArray<float>* copy : {&query_, &key_, &value_, &key_padding_, &attn_mask_}) {
    converted_bytes_ += static_cast<int64_t>(copy->size() * sizeof(float));
  }
  converted_bytes_ += static_cast<int64_t>(bool_key_padding_.size() + bool_attn_mask_.size());
  return absl::OkStatus();
}

int64_t TensorView::byte_size() const {
  int64_t size = static_cast<int64_t>(bytes.size());
  for (absl::Span<const uint8_t> piece : pieces) size += static_cast<int64_t>(piece.size());
  return size;
}

int64_t AttentionRequest::output_elements() const {
  int64_t n = 1;
  for (int64_t d : output_shape_) n *= d;
  return n;
}

int64_t AttentionRequest::weights_elements() const {
  if (!need_weights_) return 0;
  int64_t n = 1;
  for (int64_t d : weights_shape_) n *= d;
  return n;
}

BatchShape AttentionRequest::shape() const {
  BatchShape shape{.rows = rows(),
                   .q_len = q_len_,
                   .kv_len = kv_len_,
                   .self_attention = kind() == AttentionKind::kSelf,
                   .value_is_key = kind() != AttentionKind::kCross,
                   .need_weights = need_weights_};
  for (const MaskView* m : {&batch_.key_padding_mask, &batch_.attn_mask}) {
    if (m->present() && m->dtype == DType::kBool) shape.bool_mask_elements += m->num_elements;
  }
  return shape;
}

}  // namespace mha
