// Tests of engine/attention_request.h: PyTorch-shaped inputs, as views of
// their bytes, checked and bound to an AttentionBatch.
#include "engine/attention_request.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_batch.h"
#include "engine/model_config.h"
#include "engine/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using ::mha::testing::RandomVector;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// E = kdim = vdim = 24, 4 heads.
AttentionDims SelfDims() { return ::mha::testing::MakeDims(24, 4); }

// E = 24, kdim = 16, vdim = 20, 4 heads.
AttentionDims CrossDims() {
  AttentionDims d = SelfDims();
  d.kdim = 16;
  d.vdim = 20;
  return d;
}

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A F32 tensor of random values; `seed` tells tensors apart.
Tensor Random(std::vector<int64_t> shape, uint32_t seed) {
  const int64_t n = Product(shape);
  return MakeF32Tensor(std::move(shape), RandomVector(n, seed));
}

Tensor Bools(std::vector<int64_t> shape) {
  Tensor t(DType::kBool, std::move(shape));
  for (int64_t i = 0; i < t.num_elements(); i += 3) t.raw()[i] = 1;
  return t;
}

std::vector<float> Values(absl::Span<const float> span) {
  return std::vector<float>(span.begin(), span.end());
}

// Owned tensors for a request (views of them go to AttentionRequest).
struct DenseInputs {
  Tensor query;
  std::optional<Tensor> key, value, key_padding_mask, attn_mask;
  bool is_causal = false;
  bool need_weights = false;
  bool per_head_weights = false;
};

RequestInputs Views(const DenseInputs& in) {
  auto view = [](const std::optional<Tensor>& t) {
    return t.has_value() ? std::optional<TensorView>(ViewOf(*t)) : std::nullopt;
  };
  RequestInputs r;
  r.query = ViewOf(in.query);
  r.key = view(in.key);
  r.value = view(in.value);
  r.key_padding_mask = view(in.key_padding_mask);
  r.attn_mask = view(in.attn_mask);
  r.is_causal = in.is_causal;
  r.need_weights = in.need_weights;
  r.per_head_weights = in.per_head_weights;
  return r;
}

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// The request made from a copy of `in` that it keeps alive.
absl::StatusOr<AttentionRequest> Create(const AttentionDims& dims, const DenseInputs& in,
                                        DTypeSpelling spelling = DTypeSpelling::kSafetensors) {
  auto owned = std::make_shared<DenseInputs>(in);
  absl::StatusOr<AttentionRequest> r =
      AttentionRequest::Create(dims, Views(*owned), kNoLimit, spelling);
  if (r.ok()) r->KeepAlive(owned);
  return r;
}

std::vector<int64_t> WeightsShape(const AttentionDims& dims, DenseInputs in, bool per_head) {
  in.need_weights = true;
  in.per_head_weights = per_head;
  return Create(dims, in).value().weights_shape();
}

DenseInputs QueryOnly(std::vector<int64_t> shape) {
  DenseInputs in;
  in.query = Random(std::move(shape), 1);
  return in;
}

// A random query and key (value = key).
DenseInputs QueryAndKey(std::vector<int64_t> query, std::vector<int64_t> key) {
  DenseInputs in = QueryOnly(std::move(query));
  in.key = Random(std::move(key), 2);
  return in;
}

// A random query, key and value.
DenseInputs QueryKeyValue(std::vector<int64_t> query, std::vector<int64_t> key,
                          std::vector<int64_t> value) {
  DenseInputs in = QueryAndKey(std::move(query), std::move(key));
  in.value = Random(std::move(value), 3);
  return in;
}

// Expects Create to fail with INVALID_ARGUMENT containing every `parts`.
void ExpectRejected(const AttentionDims& dims, const DenseInputs& inputs,
                    const std::vector<std::string>& parts) {
  absl::StatusOr<AttentionRequest> batch = Create(dims, inputs);
  ASSERT_FALSE(batch.ok());
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_THAT(std::string(batch.status().message()), HasSubstr(part));
  }
}

// The bound batch passes the engine's own consistency check.
void ExpectValid(const AttentionDims& dims, const AttentionRequest& batch) {
  std::vector<float> output(static_cast<size_t>(Product(batch.output_shape())));
  AttentionOutputs out;
  out.output = absl::MakeSpan(output);
  const absl::Status status = ValidateBatch(dims, batch.batch(), out);
  EXPECT_TRUE(status.ok()) << status;
}

// --- Accepted inputs ---------------------------------------------------------

TEST(AttentionRequestTest, BatchedSelfAttention) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  const std::vector<float> query = ToFloatVector(in.query);
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  const AttentionBatch& ab = b->batch();
  EXPECT_EQ(Values(ab.query), query);
  EXPECT_TRUE(ab.self_attention());
  EXPECT_TRUE(ab.value.empty());
  EXPECT_THAT(ab.q_offsets, ElementsAre(0, 5, 10));
  EXPECT_EQ(ab.num_rows(), 2);
  EXPECT_FALSE(ab.key_padding_mask.present());
  EXPECT_FALSE(ab.attn_mask.present());
  EXPECT_FALSE(ab.is_causal);
  EXPECT_THAT(b->output_shape(), ElementsAre(2, 5, 24));
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(2, 5, 5));
  EXPECT_THAT(WeightsShape(d, in, true), ElementsAre(2, 4, 5, 5));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, UnbatchedQueryIsOneSequence) {
  const AttentionDims d = SelfDims();
  const DenseInputs in = QueryOnly({5, 24});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->batch().q_offsets, ElementsAre(0, 5));
  EXPECT_EQ(b->batch().query.size(), 5u * 24u);
  EXPECT_THAT(b->output_shape(), ElementsAre(5, 24));
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(5, 5));
  EXPECT_THAT(WeightsShape(d, in, true), ElementsAre(4, 5, 5));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, IsCausalIsPassedOn) {
  DenseInputs in = QueryOnly({1, 3, 24});
  in.is_causal = true;
  absl::StatusOr<AttentionRequest> b = Create(SelfDims(), in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->batch().is_causal);
}

TEST(AttentionRequestTest, KeyWithoutValueUsesTheKeyAsValue) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  const std::vector<float> key = ToFloatVector(*in.key);
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->batch().self_attention());
  EXPECT_EQ(Values(b->batch().key), key);
  EXPECT_TRUE(b->batch().value.empty());
  EXPECT_THAT(b->batch().q_offsets, ElementsAre(0, 5, 10));
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 7, 14));
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(2, 5, 7));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, KeyAndValueWithTheirOwnWidths) {
  const AttentionDims d = CrossDims();
  DenseInputs in = QueryKeyValue({3, 2, 24}, {3, 4, 16}, {3, 4, 20});
  const std::vector<float> value = ToFloatVector(*in.value);
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->batch().key.size(), 3u * 4u * 16u);
  EXPECT_EQ(Values(b->batch().value), value);
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 4, 8, 12));
  EXPECT_THAT(b->output_shape(), ElementsAre(3, 2, 24));
  EXPECT_THAT(WeightsShape(d, in, true), ElementsAre(3, 4, 2, 4));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, UnbatchedKeyAndValue) {
  const AttentionDims d = CrossDims();
  DenseInputs in = QueryKeyValue({2, 24}, {6, 16}, {6, 20});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 6));
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(2, 6));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, F16QueryIsConvertedToF32) {
  // 1, -2, 0.5, 0 repeated.
  const uint16_t pattern[4] = {0x3C00, 0xC000, 0x3800, 0x0000};
  Tensor query(DType::kF16, {1, 2, 24});
  std::vector<float> want;
  for (int i = 0; i < 48; ++i) {
    std::memcpy(query.raw() + 2 * i, &pattern[i % 4], 2);
    want.push_back(HalfToFloat(pattern[i % 4]));
  }
  ASSERT_EQ(want[1], -2.0f);
  DenseInputs in;
  in.query = std::move(query);
  absl::StatusOr<AttentionRequest> b = Create(SelfDims(), in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Values(b->batch().query), want);
}

TEST(AttentionRequestTest, Bf16KeyIsConvertedToF32) {
  Tensor key(DType::kBF16, {1, 1, 24});
  for (int i = 0; i < 24; ++i) {
    const uint16_t bits = FloatToBf16(static_cast<float>(i) - 12.0f);
    std::memcpy(key.raw() + 2 * i, &bits, 2);
  }
  DenseInputs in = QueryOnly({1, 2, 24});
  in.key = std::move(key);
  absl::StatusOr<AttentionRequest> b = Create(SelfDims(), in);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->batch().key.size(), 24u);
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(b->batch().key[i], static_cast<float>(i) - 12.0f);
  }
}

TEST(AttentionRequestTest, BoolKeyPaddingMaskStaysBool) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  in.key_padding_mask = Bools({2, 7});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  const MaskView& m = b->batch().key_padding_mask;
  ASSERT_TRUE(m.present());
  EXPECT_EQ(m.dtype, DType::kBool);
  EXPECT_EQ(m.num_elements, 14);
  EXPECT_EQ(static_cast<const uint8_t*>(m.data)[0], 1);
  EXPECT_EQ(static_cast<const uint8_t*>(m.data)[1], 0);
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, HalfFloatMaskIsRejectedNamingTheAcceptedDTypes) {
  DenseInputs in = QueryOnly({5, 24});
  in.key_padding_mask = Tensor(DType::kF16, {5});
  ExpectRejected(SelfDims(), in, {"key_padding_mask: dtype F16, expected BOOL or F32"});
}

TEST(AttentionRequestTest, UnbatchedKeyPaddingMaskIsOneDimensional) {
  DenseInputs in = QueryOnly({5, 24});
  in.key_padding_mask = Bools({5});
  absl::StatusOr<AttentionRequest> b = Create(SelfDims(), in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->batch().key_padding_mask.num_elements, 5);
}

TEST(AttentionRequestTest, SharedAttnMaskHasZeroOffsets) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  in.attn_mask = Random({5, 7}, 4);
  const std::vector<float> mask = ToFloatVector(*in.attn_mask);
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  const AttentionBatch& ab = b->batch();
  ASSERT_TRUE(ab.attn_mask.present());
  EXPECT_EQ(ab.attn_mask.dtype, DType::kF32);
  EXPECT_EQ(ab.attn_mask.num_elements, 35);
  EXPECT_EQ(static_cast<const float*>(ab.attn_mask.data)[34], mask[34]);
  EXPECT_FALSE(ab.attn_mask_per_head);
  EXPECT_THAT(ab.attn_mask_offsets, ElementsAre(0, 0));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, PerHeadAttnMaskHasOneBlockPerSequence) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  in.attn_mask = Bools({8, 5, 7});  // B * h = 8
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  const AttentionBatch& ab = b->batch();
  ASSERT_TRUE(ab.attn_mask.present());
  EXPECT_EQ(ab.attn_mask.dtype, DType::kBool);
  EXPECT_EQ(ab.attn_mask.num_elements, 8 * 5 * 7);
  EXPECT_TRUE(ab.attn_mask_per_head);
  EXPECT_THAT(ab.attn_mask_offsets, ElementsAre(0, 4 * 5 * 7));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, UnbatchedPerHeadAttnMask) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({5, 24});
  in.attn_mask = Bools({4, 5, 5});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->batch().attn_mask_per_head);
  EXPECT_THAT(b->batch().attn_mask_offsets, ElementsAre(0));
  ExpectValid(d, *b);
}

TEST(AttentionRequestTest, MovedBatchStillSeesItsInputs) {
  DenseInputs in = QueryOnly({2, 3, 24});
  in.attn_mask = Random({3, 3}, 4);
  const std::vector<float> query = ToFloatVector(in.query);
  absl::StatusOr<AttentionRequest> first = Create(SelfDims(), in);
  ASSERT_TRUE(first.ok()) << first.status();
  AttentionRequest second = *std::move(first);
  EXPECT_EQ(Values(second.batch().query), query);
  EXPECT_TRUE(second.batch().attn_mask.present());
}

// --- WeightsShape with extra key positions -----------------------------------

TEST(AttentionRequestTest, WeightsShapeCountsBiasKvAndZeroAttn) {
  AttentionDims d = SelfDims();
  d.add_bias_kv = true;
  d.add_zero_attn = true;
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(2, 5, 9));
  EXPECT_THAT(WeightsShape(d, in, true), ElementsAre(2, 4, 5, 9));
  EXPECT_THAT(b->output_shape(), ElementsAre(2, 5, 24));
}

TEST(AttentionRequestTest, WeightsShapeCountsOneExtraKey) {
  AttentionDims d = SelfDims();
  d.add_zero_attn = true;
  const DenseInputs in = QueryOnly({5, 24});
  absl::StatusOr<AttentionRequest> b = Create(d, in);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(WeightsShape(d, in, false), ElementsAre(5, 6));
  EXPECT_THAT(WeightsShape(d, in, true), ElementsAre(4, 5, 6));
}

// --- Rejected inputs ---------------------------------------------------------

TEST(AttentionRequestTest, ValueWithoutKeyIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.value = Random({2, 5, 24}, 3);
  ExpectRejected(SelfDims(), in, {"value"});
}

TEST(AttentionRequestTest, QueryOfRankOneIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({24}), {"query", "[24]"});
}

TEST(AttentionRequestTest, QueryOfRankFourIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({1, 2, 5, 24}), {"query", "[1, 2, 5, 24]"});
}

TEST(AttentionRequestTest, QueryWithWrongEmbedDimIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({2, 5, 23}), {"query: expected last dimension 24, got 23"});
}

TEST(AttentionRequestTest, BoolQueryIsRejected) {
  DenseInputs in;
  in.query = Bools({2, 5, 24});
  ExpectRejected(SelfDims(), in, {"query", "BOOL"});
}

TEST(AttentionRequestTest, BoolKeyIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Bools({2, 5, 24});
  ExpectRejected(SelfDims(), in, {"key", "BOOL"});
}

TEST(AttentionRequestTest, KeyWithOtherBatchSizeIsRejected) {
  ExpectRejected(CrossDims(), QueryKeyValue({2, 5, 24}, {3, 7, 16}, {3, 7, 20}),
                 {"key", "batch size 2", "got 3"});
}

TEST(AttentionRequestTest, KeyWithWrongWidthIsRejected) {
  ExpectRejected(CrossDims(), QueryKeyValue({2, 5, 24}, {2, 7, 15}, {2, 7, 20}),
                 {"key: expected last dimension 16, got 15"});
}

TEST(AttentionRequestTest, UnbatchedKeyWithBatchedQueryIsRejected) {
  ExpectRejected(SelfDims(), QueryAndKey({2, 5, 24}, {7, 24}), {"key", "rank"});
}

TEST(AttentionRequestTest, ValueWithOtherLengthIsRejected) {
  ExpectRejected(CrossDims(), QueryKeyValue({2, 5, 24}, {2, 7, 16}, {2, 6, 20}),
                 {"value: expected shape [2, 7, 20], got [2, 6, 20]"});
}

TEST(AttentionRequestTest, ValueWithWrongWidthIsRejected) {
  ExpectRejected(CrossDims(), QueryKeyValue({2, 5, 24}, {2, 7, 16}, {2, 7, 16}),
                 {"value: expected shape [2, 7, 20], got [2, 7, 16]"});
}

TEST(AttentionRequestTest, KeyPaddingMaskOfQueryLengthWithLongerKeyIsRejected) {
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  in.key_padding_mask = Bools({2, 5});
  ExpectRejected(SelfDims(), in, {"key_padding_mask: expected shape [2, 7], got [2, 5]"});
}

TEST(AttentionRequestTest, KeyPaddingMaskTransposedIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key_padding_mask = Bools({5, 2});
  ExpectRejected(SelfDims(), in, {"key_padding_mask", "[2, 5]", "[5, 2]"});
}

TEST(AttentionRequestTest, AttnMaskOfWrongLengthNamesBothAcceptedShapes) {
  DenseInputs in = QueryAndKey({2, 5, 24}, {2, 7, 24});
  in.attn_mask = Bools({5, 8});
  ExpectRejected(SelfDims(), in, {"attn_mask", "[5, 7]", "[8, 5, 7]", "got [5, 8]"});
}

TEST(AttentionRequestTest, AttnMaskPerBatchInsteadOfPerHeadIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.attn_mask = Bools({2, 5, 5});
  ExpectRejected(SelfDims(), in, {"attn_mask", "[5, 5]", "[8, 5, 5]", "got [2, 5, 5]"});
}

TEST(AttentionRequestTest, AttnMaskWithBatchAndHeadAxesIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.attn_mask = Bools({2, 4, 5, 5});
  ExpectRejected(SelfDims(), in, {"attn_mask", "[5, 5]", "[8, 5, 5]"});
}

// --- Kinds, views, limits, spellings -----------------------------------------

TEST(AttentionRequestTest, KindIsStatedForEachInputCombination) {
  DenseInputs in = QueryOnly({1, 2, 24});
  EXPECT_EQ(Create(SelfDims(), in)->kind(), AttentionKind::kSelf);
  in.key = Random({1, 3, 24}, 2);
  EXPECT_EQ(Create(SelfDims(), in)->kind(), AttentionKind::kCrossValueIsKey);
  in.value = Random({1, 3, 24}, 3);
  EXPECT_EQ(Create(SelfDims(), in)->kind(), AttentionKind::kCross);
}

TEST(AttentionRequestTest, AlignedF32BytesAreUsedInPlace) {
  const Tensor query = Random({2, 3, 24}, 1);
  RequestInputs in;
  in.query = ViewOf(query);
  absl::StatusOr<AttentionRequest> r =
      AttentionRequest::Create(SelfDims(), in, kNoLimit, DTypeSpelling::kSafetensors);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(static_cast<const void*>(r->batch().query.data()), query.raw());
  EXPECT_EQ(r->converted_bytes(), 0);
  EXPECT_EQ(r->wire_bytes(), 2 * 3 * 24 * 4);
}

TEST(AttentionRequestTest, UnalignedF32BytesAreCopiedOnce) {
  const Tensor query = Random({1, 2, 24}, 1);
  std::vector<uint8_t> shifted(query.num_bytes() + 1);
  std::memcpy(shifted.data() + 1, query.raw(), query.num_bytes());
  RequestInputs in;
  in.query = TensorView{DType::kF32, {1, 2, 24}, absl::MakeConstSpan(shifted).subspan(1), {}};
  absl::StatusOr<AttentionRequest> r =
      AttentionRequest::Create(SelfDims(), in, kNoLimit, DTypeSpelling::kSafetensors);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Values(r->batch().query), ToFloatVector(query));
  EXPECT_EQ(r->converted_bytes(), 48 * 4);
}

TEST(AttentionRequestTest, NonFiniteInputsAreRejectedWithTheirIndex) {
  DenseInputs in = QueryAndKey({1, 2, 24}, {1, 3, 24});
  in.key->f32()[7] = std::numeric_limits<float>::infinity();
  ExpectRejected(SelfDims(), in, {"key: element 7 is inf", "finite"});
}

TEST(AttentionRequestTest, FloatMaskMayHoldMinusInfButNotPlusInfOrNan) {
  DenseInputs in = QueryOnly({1, 2, 24});
  in.attn_mask = Random({2, 2}, 4);
  in.attn_mask->f32()[1] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(Create(SelfDims(), in).ok());
  in.attn_mask->f32()[3] = std::numeric_limits<float>::infinity();
  ExpectRejected(SelfDims(), in, {"attn_mask: element 3 is inf", "or -inf"});
  in.attn_mask->f32()[3] = std::numeric_limits<float>::quiet_NaN();
  ExpectRejected(SelfDims(), in, {"attn_mask: element 3 is nan"});
}

TEST(AttentionRequestTest, TooManyTokensIsRefusedBeforeAnyConversion) {
  const DenseInputs in = QueryOnly({2, 5, 24});
  const absl::StatusOr<AttentionRequest> r =
      AttentionRequest::Create(SelfDims(), Views(in), 19, DTypeSpelling::kSafetensors);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("20 query + key tokens"));
}

TEST(AttentionRequestTest, ErrorsSpellDTypesAsTheFrontEndDoes) {
  DenseInputs in;
  in.query = Bools({1, 2, 24});
  EXPECT_THAT(std::string(Create(SelfDims(), in, DTypeSpelling::kKserve).status().message()),
              HasSubstr("query: dtype BOOL, expected FP32, BF16 or FP16"));
  EXPECT_THAT(std::string(Create(SelfDims(), in, DTypeSpelling::kMhaV1).status().message()),
              HasSubstr("expected DATA_TYPE_FP32, DATA_TYPE_BF16 or DATA_TYPE_FP16"));
}

TEST(AttentionRequestTest, BytesThatAreNotTheShapeAreRejected) {
  const Tensor query = Random({1, 2, 24}, 1);
  RequestInputs in;
  in.query = TensorView{DType::kF32, {1, 2, 24}, absl::MakeConstSpan(query.raw(), 100), {}};
  const absl::Status s =
      AttentionRequest::Create(SelfDims(), in, kNoLimit, DTypeSpelling::kKserve).status();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("query: data has 100 bytes, expected 1 x 2 x 24 x 4 bytes (FP32)"));
}

}  // namespace
}  // namespace mha
