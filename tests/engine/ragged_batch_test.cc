// Tests of engine/ragged_batch.h: requests of every kind, with masks of
// either form, merged into one engine call; each gets exactly what it gets
// computed alone.
#include "engine/ragged_batch.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/mha_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using ::mha::testing::RandomVector;
using ::testing::ElementsAre;

constexpr int64_t kE = 24, kHeads = 4;

// Owned tensors of one request and the request viewing them.
struct Owned {
  std::vector<Tensor> tensors;
};

Tensor F32(std::vector<int64_t> shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return MakeF32Tensor(std::move(shape), RandomVector(n, seed));
}

// A bool mask with every third element set, and its first element clear
// (no row is fully masked).
Tensor Bools(std::vector<int64_t> shape, int phase) {
  Tensor t(DType::kBool, std::move(shape));
  for (int64_t i = 1; i < t.num_elements(); ++i) t.raw()[i] = (i + phase) % 3 == 0;
  return t;
}

struct Spec {
  AttentionKind kind = AttentionKind::kSelf;
  int64_t batch = 1, q_len = 3, kv_len = 3;
  bool key_padding = false;
  enum { kNoMask, kShared, kPerHead } attn_mask = kNoMask;
  DType mask_dtype = DType::kBool;
  bool causal = false;
  bool weights = false, per_head = false;
};

AttentionRequest Make(const AttentionDims& d, const Spec& s, uint32_t seed) {
  const int64_t kv_len = s.kind == AttentionKind::kSelf ? s.q_len : s.kv_len;
  auto owned = std::make_shared<Owned>();
  owned->tensors.reserve(5);
  auto add = [&](Tensor t) { return ViewOf(owned->tensors.emplace_back(std::move(t))); };
  RequestInputs in;
  in.query = add(F32({s.batch, s.q_len, d.embed_dim}, seed));
  if (s.kind != AttentionKind::kSelf) in.key = add(F32({s.batch, kv_len, d.kdim}, seed + 1));
  if (s.kind == AttentionKind::kCross) in.value = add(F32({s.batch, kv_len, d.vdim}, seed + 2));
  if (s.key_padding) in.key_padding_mask = add(Bools({s.batch, kv_len}, static_cast<int>(seed)));
  if (s.attn_mask != Spec::kNoMask) {
    std::vector<int64_t> shape = {s.q_len, kv_len};
    if (s.attn_mask == Spec::kPerHead) shape.insert(shape.begin(), s.batch * d.num_heads);
    in.attn_mask = add(s.mask_dtype == DType::kBool ? Bools(shape, static_cast<int>(seed) + 1)
                                                    : F32(shape, seed + 3));
  }
  in.is_causal = s.causal;
  in.need_weights = s.weights;
  in.per_head_weights = s.per_head;
  AttentionRequest r = AttentionRequest::Create(d, in, std::numeric_limits<int64_t>::max(),
                                                DTypeSpelling::kSafetensors)
                           .value();
  r.KeepAlive(std::move(owned));
  return r;
}

struct Results {
  std::vector<float> output, weights;
};

Results Run(const MhaEngine& engine, const RaggedBatch& batch) {
  Results r{std::vector<float>(batch.output_elements()),
            std::vector<float>(batch.weights_elements())};
  auto ws = engine.NewWorkspace();
  const absl::Status s = engine.Run(
      batch.batch(),
      {absl::MakeSpan(r.output), absl::MakeSpan(r.weights), batch.per_head_weights()}, *ws);
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

void ExpectNear(absl::Span<const float> got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
}

// Requests of one signature and different lengths, merged: each one's slice
// of the merged results equals the request computed alone.
void ExpectMergedEqualsAlone(const AttentionDims& d, Spec s) {
  const std::unique_ptr<MhaEngine> engine =
      MhaEngine::Create(d, testing::RandomWeights(d, 9)).value();
  std::vector<AttentionRequest> requests;
  const int64_t lengths[][3] = {{1, 3, 5}, {2, 6, 2}, {1, 1, 7}};  // batch, q_len, kv_len
  for (int i = 0; i < 3; ++i) {
    s.batch = lengths[i][0];
    s.q_len = lengths[i][1];
    s.kv_len = lengths[i][2];  // self-attention: the query's
    requests.push_back(Make(d, s, 10 * i + 1));
  }
  std::vector<const AttentionRequest*> all;
  for (const AttentionRequest& r : requests) all.push_back(&r);
  for (const AttentionRequest* r : all)
    ASSERT_EQ(BatchSignature::Of(*r), BatchSignature::Of(*all[0]));
  const RaggedBatch merged(all);
  EXPECT_EQ(merged.batch().num_rows(), 1 + 2 + 1);
  const Results together = Run(*engine, merged);
  for (size_t i = 0; i < all.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    const RaggedBatch alone(absl::MakeConstSpan(&all[i], 1));
    const Results expected = Run(*engine, alone);
    ExpectNear(merged.OutputOf(i, together.output), expected.output);
    ExpectNear(merged.WeightsOf(i, together.weights), expected.weights);
    EXPECT_EQ(static_cast<int64_t>(expected.weights.size()), all[i]->weights_elements());
  }
}

AttentionDims SelfDims() { return testing::MakeDims(kE, kHeads); }

AttentionDims CrossDims() {
  AttentionDims d = SelfDims();
  d.kdim = 16;
  d.vdim = 20;
  return d;
}

TEST(RaggedBatchTest, SelfAttentionWithBoolMasksAndWeights) {
  ExpectMergedEqualsAlone(SelfDims(), {.kind = AttentionKind::kSelf,
                                       .key_padding = true,
                                       .attn_mask = Spec::kPerHead,
                                       .weights = true});
}

TEST(RaggedBatchTest, CausalSelfAttentionWithASharedFloatMask) {
  ExpectMergedEqualsAlone(SelfDims(), {.kind = AttentionKind::kSelf,
                                       .attn_mask = Spec::kShared,
                                       .mask_dtype = DType::kF32,
                                       .causal = true});
}

TEST(RaggedBatchTest, CrossAttentionWithValueIsKeyAndPerHeadWeights) {
  AttentionDims d = CrossDims();
  d.vdim = d.kdim;
  d.add_bias_kv = true;
  ExpectMergedEqualsAlone(d, {.kind = AttentionKind::kCrossValueIsKey,
                              .key_padding = true,
                              .weights = true,
                              .per_head = true});
}

TEST(RaggedBatchTest, CrossAttentionWithItsOwnValueAndAPerHeadFloatMask) {
  AttentionDims d = CrossDims();
  d.add_zero_attn = true;
  ExpectMergedEqualsAlone(d, {.kind = AttentionKind::kCross,
                              .attn_mask = Spec::kPerHead,
                              .mask_dtype = DType::kF32,
                              .weights = true});
}

TEST(RaggedBatchTest, OffsetsFollowTheRequestsAndMissingPaddingIsZeros) {
  const AttentionDims d = SelfDims();
  const AttentionRequest a = Make(d, {.q_len = 3, .key_padding = true}, 1);
  const AttentionRequest b = Make(d, {.q_len = 5}, 2);
  EXPECT_EQ(BatchSignature::Of(a), BatchSignature::Of(b));  // no mask joins BOOL masks
  const AttentionRequest* both[] = {&a, &b};
  const RaggedBatch merged(both);
  EXPECT_THAT(merged.batch().q_offsets, ElementsAre(0, 3, 8));
  EXPECT_EQ(merged.output_elements(), 8 * kE);
  EXPECT_EQ(merged.OutputOf(1, std::vector<float>(8 * kE)).size(), 5u * kE);
  const MaskView& kpm = merged.batch().key_padding_mask;
  ASSERT_TRUE(kpm.present());
  EXPECT_EQ(kpm.dtype, DType::kBool);
  ASSERT_EQ(kpm.num_elements, 8);
  const auto* bytes = static_cast<const uint8_t*>(kpm.data);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(bytes[i], static_cast<const uint8_t*>(a.batch().key_padding_mask.data)[i]);
  }
  for (int i = 3; i < 8; ++i) EXPECT_EQ(bytes[i], 0) << i;
}

TEST(RaggedBatchTest, OneRequestIsBorrowedNotCopied) {
  const AttentionRequest a =
      Make(SelfDims(), {.q_len = 4, .key_padding = true, .weights = true}, 3);
  const AttentionRequest* one[] = {&a};
  const RaggedBatch batch(one);
  EXPECT_EQ(batch.batch().query.data(), a.batch().query.data());
  EXPECT_EQ(batch.batch().key_padding_mask.data, a.batch().key_padding_mask.data);
  EXPECT_EQ(batch.weights_elements(), 4 * 4);
}

// Session steps' rows follow the requests' in one buffer (the engine then
// projects both without a copy); a lone request is copied for that.
TEST(RaggedBatchTest, RowsAfterFollowTheRequestsQueryRows) {
  const AttentionRequest a = Make(SelfDims(), {.q_len = 4, .key_padding = true}, 3);
  const AttentionRequest* one[] = {&a};
  const std::vector<float> steps = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const RaggedBatch batch(one, steps);
  const absl::Span<const float> query = batch.batch().query;
  ASSERT_EQ(query.size(), a.batch().query.size());
  EXPECT_NE(query.data(), a.batch().query.data());
  EXPECT_TRUE(std::equal(query.begin(), query.end(), a.batch().query.begin()));
  ASSERT_EQ(batch.rows_after().size(), steps.size());
  EXPECT_EQ(batch.rows_after().data(), query.data() + query.size());
  EXPECT_TRUE(std::equal(steps.begin(), steps.end(), batch.rows_after().begin()));
  EXPECT_EQ(batch.batch().q_offsets, a.batch().q_offsets);
}

TEST(RaggedBatchTest, SignaturesSeparateWhatCannotShareACall) {
  const AttentionDims d = SelfDims();
  const BatchSignature plain = BatchSignature::Of(Make(d, {}, 1));
  EXPECT_NE(BatchSignature::Of(Make(d, {.causal = true}, 1)), plain);
  EXPECT_NE(BatchSignature::Of(Make(d, {.attn_mask = Spec::kShared}, 1)), plain);
  EXPECT_NE(BatchSignature::Of(Make(d, {.attn_mask = Spec::kShared}, 1)),
            BatchSignature::Of(Make(d, {.attn_mask = Spec::kPerHead}, 1)));
  EXPECT_NE(
      BatchSignature::Of(Make(d, {.attn_mask = Spec::kShared}, 1)),
      BatchSignature::Of(Make(d, {.attn_mask = Spec::kShared, .mask_dtype = DType::kF32}, 1)));
  EXPECT_NE(BatchSignature::Of(Make(d, {.weights = true}, 1)), plain);
  EXPECT_NE(BatchSignature::Of(Make(d, {.kind = AttentionKind::kCrossValueIsKey}, 1)), plain);
}

}  // namespace
}  // namespace mha
