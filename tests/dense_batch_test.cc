// Tests of engine/dense_batch.h: PyTorch-shaped inputs checked and bound to
// an AttentionBatch.
#include "engine/dense_batch.h"

#include <cstdint>
#include <cstring>
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
#include "tests/test_models.h"

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

DenseInputs QueryOnly(std::vector<int64_t> shape) {
  DenseInputs in;
  in.query = Random(std::move(shape), 1);
  return in;
}

// Expects Create to fail with INVALID_ARGUMENT containing every `parts`.
void ExpectRejected(const AttentionDims& dims, DenseInputs inputs,
                    const std::vector<std::string>& parts) {
  absl::StatusOr<DenseBatch> batch =
      DenseBatch::Create(dims, std::move(inputs));
  ASSERT_FALSE(batch.ok());
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_THAT(std::string(batch.status().message()), HasSubstr(part));
  }
}

// The bound batch passes the engine's own consistency check.
void ExpectValid(const AttentionDims& dims, const DenseBatch& batch) {
  std::vector<float> output(static_cast<size_t>(Product(batch.OutputShape())));
  AttentionOutputs out;
  out.output = absl::MakeSpan(output);
  const absl::Status status = ValidateBatch(dims, batch.batch(), out);
  EXPECT_TRUE(status.ok()) << status;
}

// --- Accepted inputs ---------------------------------------------------------

TEST(DenseBatchTest, BatchedSelfAttention) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  const std::vector<float> query = ToFloatVector(in.query);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  const AttentionBatch& ab = b->batch();
  EXPECT_EQ(Values(ab.query), query);
  EXPECT_TRUE(ab.self_attention());
  EXPECT_TRUE(ab.value.empty());
  EXPECT_THAT(ab.q_offsets, ElementsAre(0, 5, 10));
  EXPECT_EQ(ab.num_sequences(), 2);
  EXPECT_FALSE(ab.key_padding_mask.present());
  EXPECT_FALSE(ab.attn_mask.present());
  EXPECT_FALSE(ab.is_causal);
  EXPECT_THAT(b->OutputShape(), ElementsAre(2, 5, 24));
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(2, 5, 5));
  EXPECT_THAT(b->WeightsShape(true), ElementsAre(2, 4, 5, 5));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, UnbatchedQueryIsOneSequence) {
  const AttentionDims d = SelfDims();
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, QueryOnly({5, 24}));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->batch().q_offsets, ElementsAre(0, 5));
  EXPECT_EQ(b->batch().query.size(), 5u * 24u);
  EXPECT_THAT(b->OutputShape(), ElementsAre(5, 24));
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(5, 5));
  EXPECT_THAT(b->WeightsShape(true), ElementsAre(4, 5, 5));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, IsCausalIsPassedOn) {
  DenseInputs in = QueryOnly({1, 3, 24});
  in.is_causal = true;
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->batch().is_causal);
}

TEST(DenseBatchTest, KeyWithoutValueUsesTheKeyAsValue) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  const std::vector<float> key = ToFloatVector(*in.key);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->batch().self_attention());
  EXPECT_EQ(Values(b->batch().key), key);
  EXPECT_TRUE(b->batch().value.empty());
  EXPECT_THAT(b->batch().q_offsets, ElementsAre(0, 5, 10));
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 7, 14));
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(2, 5, 7));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, KeyAndValueWithTheirOwnWidths) {
  const AttentionDims d = CrossDims();
  DenseInputs in = QueryOnly({3, 2, 24});
  in.key = Random({3, 4, 16}, 2);
  in.value = Random({3, 4, 20}, 3);
  const std::vector<float> value = ToFloatVector(*in.value);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->batch().key.size(), 3u * 4u * 16u);
  EXPECT_EQ(Values(b->batch().value), value);
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 4, 8, 12));
  EXPECT_THAT(b->OutputShape(), ElementsAre(3, 2, 24));
  EXPECT_THAT(b->WeightsShape(true), ElementsAre(3, 4, 2, 4));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, UnbatchedKeyAndValue) {
  const AttentionDims d = CrossDims();
  DenseInputs in = QueryOnly({2, 24});
  in.key = Random({6, 16}, 2);
  in.value = Random({6, 20}, 3);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->batch().kv_offsets, ElementsAre(0, 6));
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(2, 6));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, F16QueryIsConvertedToF32) {
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
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Values(b->batch().query), want);
}

TEST(DenseBatchTest, Bf16KeyIsConvertedToF32) {
  Tensor key(DType::kBF16, {1, 1, 24});
  for (int i = 0; i < 24; ++i) {
    const uint16_t bits = FloatToBf16(static_cast<float>(i) - 12.0f);
    std::memcpy(key.raw() + 2 * i, &bits, 2);
  }
  DenseInputs in = QueryOnly({1, 2, 24});
  in.key = std::move(key);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->batch().key.size(), 24u);
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(b->batch().key[i], static_cast<float>(i) - 12.0f);
  }
}

TEST(DenseBatchTest, BoolKeyPaddingMaskStaysBool) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  in.key_padding_mask = Bools({2, 7});
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  const MaskView& m = b->batch().key_padding_mask;
  ASSERT_TRUE(m.present());
  EXPECT_EQ(m.dtype, DType::kBool);
  EXPECT_EQ(m.num_elements, 14);
  EXPECT_EQ(static_cast<const uint8_t*>(m.data)[0], 1);
  EXPECT_EQ(static_cast<const uint8_t*>(m.data)[1], 0);
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, F16KeyPaddingMaskBecomesF32) {
  Tensor mask(DType::kF16, {5});
  const uint16_t minus_two = 0xC000;
  std::memcpy(mask.raw(), &minus_two, 2);
  DenseInputs in = QueryOnly({5, 24});
  in.key_padding_mask = std::move(mask);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  const MaskView& m = b->batch().key_padding_mask;
  ASSERT_TRUE(m.present());
  EXPECT_EQ(m.dtype, DType::kF32);
  EXPECT_EQ(static_cast<const float*>(m.data)[0], -2.0f);
  EXPECT_EQ(static_cast<const float*>(m.data)[1], 0.0f);
}

TEST(DenseBatchTest, UnbatchedKeyPaddingMaskIsOneDimensional) {
  DenseInputs in = QueryOnly({5, 24});
  in.key_padding_mask = Bools({5});
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->batch().key_padding_mask.num_elements, 5);
}

TEST(DenseBatchTest, SharedAttnMaskHasZeroOffsets) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  in.attn_mask = Random({5, 7}, 4);
  const std::vector<float> mask = ToFloatVector(*in.attn_mask);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
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

TEST(DenseBatchTest, PerHeadAttnMaskHasOneBlockPerSequence) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  in.attn_mask = Bools({8, 5, 7});  // B * h = 8
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  const AttentionBatch& ab = b->batch();
  ASSERT_TRUE(ab.attn_mask.present());
  EXPECT_EQ(ab.attn_mask.dtype, DType::kBool);
  EXPECT_EQ(ab.attn_mask.num_elements, 8 * 5 * 7);
  EXPECT_TRUE(ab.attn_mask_per_head);
  EXPECT_THAT(ab.attn_mask_offsets, ElementsAre(0, 4 * 5 * 7));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, UnbatchedPerHeadAttnMask) {
  const AttentionDims d = SelfDims();
  DenseInputs in = QueryOnly({5, 24});
  in.attn_mask = Bools({4, 5, 5});
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->batch().attn_mask_per_head);
  EXPECT_THAT(b->batch().attn_mask_offsets, ElementsAre(0));
  ExpectValid(d, *b);
}

TEST(DenseBatchTest, MovedBatchStillSeesItsInputs) {
  DenseInputs in = QueryOnly({2, 3, 24});
  in.attn_mask = Random({3, 3}, 4);
  const std::vector<float> query = ToFloatVector(in.query);
  absl::StatusOr<DenseBatch> first =
      DenseBatch::Create(SelfDims(), std::move(in));
  ASSERT_TRUE(first.ok()) << first.status();
  DenseBatch second = *std::move(first);
  EXPECT_EQ(Values(second.batch().query), query);
  EXPECT_TRUE(second.batch().attn_mask.present());
}

// --- WeightsShape with extra key positions -----------------------------------

TEST(DenseBatchTest, WeightsShapeCountsBiasKvAndZeroAttn) {
  AttentionDims d = SelfDims();
  d.add_bias_kv = true;
  d.add_zero_attn = true;
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, std::move(in));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(2, 5, 9));
  EXPECT_THAT(b->WeightsShape(true), ElementsAre(2, 4, 5, 9));
  EXPECT_THAT(b->OutputShape(), ElementsAre(2, 5, 24));
}

TEST(DenseBatchTest, WeightsShapeCountsOneExtraKey) {
  AttentionDims d = SelfDims();
  d.add_zero_attn = true;
  absl::StatusOr<DenseBatch> b = DenseBatch::Create(d, QueryOnly({5, 24}));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->WeightsShape(false), ElementsAre(5, 6));
  EXPECT_THAT(b->WeightsShape(true), ElementsAre(4, 5, 6));
}

// --- Rejected inputs ---------------------------------------------------------

TEST(DenseBatchTest, ValueWithoutKeyIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.value = Random({2, 5, 24}, 3);
  ExpectRejected(SelfDims(), std::move(in), {"value"});
}

TEST(DenseBatchTest, QueryOfRankOneIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({24}), {"query", "[24]"});
}

TEST(DenseBatchTest, QueryOfRankFourIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({1, 2, 5, 24}),
                 {"query", "[1, 2, 5, 24]"});
}

TEST(DenseBatchTest, QueryWithWrongEmbedDimIsRejected) {
  ExpectRejected(SelfDims(), QueryOnly({2, 5, 23}),
                 {"query: expected last dimension 24, got 23"});
}

TEST(DenseBatchTest, BoolQueryIsRejected) {
  DenseInputs in;
  in.query = Bools({2, 5, 24});
  ExpectRejected(SelfDims(), std::move(in), {"query", "BOOL"});
}

TEST(DenseBatchTest, BoolKeyIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Bools({2, 5, 24});
  ExpectRejected(SelfDims(), std::move(in), {"key", "BOOL"});
}

TEST(DenseBatchTest, KeyWithOtherBatchSizeIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({3, 7, 16}, 2);
  in.value = Random({3, 7, 20}, 3);
  ExpectRejected(CrossDims(), std::move(in), {"key", "batch size 2", "got 3"});
}

TEST(DenseBatchTest, KeyWithWrongWidthIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 15}, 2);
  in.value = Random({2, 7, 20}, 3);
  ExpectRejected(CrossDims(), std::move(in),
                 {"key: expected last dimension 16, got 15"});
}

TEST(DenseBatchTest, UnbatchedKeyWithBatchedQueryIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({7, 24}, 2);
  ExpectRejected(SelfDims(), std::move(in), {"key", "rank"});
}

TEST(DenseBatchTest, ValueWithOtherLengthIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 16}, 2);
  in.value = Random({2, 6, 20}, 3);
  ExpectRejected(CrossDims(), std::move(in),
                 {"value: expected shape [2, 7, 20], got [2, 6, 20]"});
}

TEST(DenseBatchTest, ValueWithWrongWidthIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 16}, 2);
  in.value = Random({2, 7, 16}, 3);
  ExpectRejected(CrossDims(), std::move(in),
                 {"value: expected shape [2, 7, 20], got [2, 7, 16]"});
}

TEST(DenseBatchTest, KeyPaddingMaskOfQueryLengthWithLongerKeyIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  in.key_padding_mask = Bools({2, 5});
  ExpectRejected(SelfDims(), std::move(in),
                 {"key_padding_mask: expected shape [2, 7], got [2, 5]"});
}

TEST(DenseBatchTest, KeyPaddingMaskTransposedIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key_padding_mask = Bools({5, 2});
  ExpectRejected(SelfDims(), std::move(in),
                 {"key_padding_mask", "[2, 5]", "[5, 2]"});
}

TEST(DenseBatchTest, AttnMaskOfWrongLengthNamesBothAcceptedShapes) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.key = Random({2, 7, 24}, 2);
  in.attn_mask = Bools({5, 8});
  ExpectRejected(SelfDims(), std::move(in),
                 {"attn_mask", "[5, 7]", "[8, 5, 7]", "got [5, 8]"});
}

TEST(DenseBatchTest, AttnMaskPerBatchInsteadOfPerHeadIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.attn_mask = Bools({2, 5, 5});
  ExpectRejected(SelfDims(), std::move(in),
                 {"attn_mask", "[5, 5]", "[8, 5, 5]", "got [2, 5, 5]"});
}

TEST(DenseBatchTest, AttnMaskWithBatchAndHeadAxesIsRejected) {
  DenseInputs in = QueryOnly({2, 5, 24});
  in.attn_mask = Bools({2, 4, 5, 5});
  ExpectRejected(SelfDims(), std::move(in),
                 {"attn_mask", "[5, 5]", "[8, 5, 5]"});
}

}  // namespace
}  // namespace mha
