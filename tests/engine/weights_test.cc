// Tests of engine/weights.h: PackWeights finds a layer's tensors in every
// layout and naming scheme and packs them exactly.
#include "engine/weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mha/v1/model_config.pb.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using ::mha::testing::ConfigFor;
using ::mha::testing::RandomWeights;
using ::mha::testing::WeightsAsTensors;
using ::testing::HasSubstr;

// E = 24, h = 4, head dims 6, everything else default.
AttentionDims BaseDims() { return ::mha::testing::MakeDims(24, 4); }

// Every optional part switched on: biases, bias_kv, post_norm.
AttentionDims FullDims() {
  AttentionDims d = BaseDims();
  d.add_bias_kv = true;
  d.post_norm = true;
  return d;
}

int64_t TotalElements(const TensorMap& tensors) {
  int64_t n = 0;
  for (const auto& [name, t] : tensors) n += t.num_elements();
  return n;
}

void ExpectSameWeights(const PackedWeights& got, const PackedWeights& want) {
  auto fields = [](const PackedWeights& w) {
    return std::tie(w.w_q, w.w_k, w.w_v, w.b_q, w.b_k, w.b_v, w.w_o, w.b_o, w.bias_k, w.bias_v,
                    w.norm_weight, w.norm_bias);
  };
  EXPECT_EQ(fields(got), fields(want));
}

// Packs `tensors` for `dims` expecting INVALID_ARGUMENT containing `parts`.
void ExpectPackError(const AttentionDims& dims, const v1::ModelConfig& config,
                     const TensorMap& tensors, const std::vector<std::string>& parts) {
  absl::StatusOr<PackedWeights> packed = PackWeights(dims, config, tensors);
  ASSERT_FALSE(packed.ok());
  EXPECT_EQ(packed.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_THAT(std::string(packed.status().message()), HasSubstr(part));
  }
}

// --- Every layout packs back to the original weights -------------------------

class PackWeightsLayoutTest : public ::testing::TestWithParam<WeightLayout> {};

TEST_P(PackWeightsLayoutTest, PacksExactlyTheOriginalWeights) {
  const AttentionDims d = FullDims();
  const PackedWeights w = RandomWeights(d, 7);
  const TensorMap tensors = WeightsAsTensors(d, w, GetParam());
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->layout, GetParam());
  ExpectSameWeights(*packed, w);
}

TEST_P(PackWeightsLayoutTest, CountsEveryStoredParameter) {
  const AttentionDims d = FullDims();
  const TensorMap tensors = WeightsAsTensors(d, RandomWeights(d, 3), GetParam());
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  // 4 E x E matrices, 4 E biases, bias_k, bias_v, norm weight and bias.
  const int64_t e = d.embed_dim;
  EXPECT_EQ(packed->parameter_count, 4 * e * e + 4 * e + 2 * e + 2 * e);
  EXPECT_EQ(packed->parameter_count, TotalElements(tensors));
}

TEST_P(PackWeightsLayoutTest, NoBiasGivesZeroBiases) {
  AttentionDims d = BaseDims();
  d.bias = false;
  const PackedWeights w = RandomWeights(d, 5);
  const TensorMap tensors = WeightsAsTensors(d, w, GetParam());
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const std::vector<float> zeros(24, 0.0f);
  EXPECT_EQ(packed->b_q, zeros);
  EXPECT_EQ(packed->b_k, zeros);
  EXPECT_EQ(packed->b_v, zeros);
  EXPECT_EQ(packed->b_o, zeros);
  EXPECT_EQ(packed->w_q, w.w_q);
  EXPECT_EQ(packed->parameter_count, 4 * 24 * 24);
}

TEST_P(PackWeightsLayoutTest, TensorPrefixIsPrepended) {
  const AttentionDims d = FullDims();
  const PackedWeights w = RandomWeights(d, 11);
  const TensorMap tensors = WeightsAsTensors(d, w, GetParam(), "encoder.layers.3.self_attn.");
  v1::ModelConfig config = ConfigFor(d);
  config.set_tensor_prefix("encoder.layers.3.self_attn.");
  absl::StatusOr<PackedWeights> packed = PackWeights(d, config, tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->layout, GetParam());
  ExpectSameWeights(*packed, w);
}

TEST_P(PackWeightsLayoutTest, IgnoresTensorsOfOtherLayers) {
  const AttentionDims d = BaseDims();
  const PackedWeights w = RandomWeights(d, 13);
  TensorMap tensors = WeightsAsTensors(d, w, GetParam(), "layer1.");
  TensorMap other = WeightsAsTensors(d, RandomWeights(d, 14), GetParam(), "layer2.");
  tensors.merge(other);
  v1::ModelConfig config = ConfigFor(d);
  config.set_tensor_prefix("layer1.");
  absl::StatusOr<PackedWeights> packed = PackWeights(d, config, tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ExpectSameWeights(*packed, w);
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, PackWeightsLayoutTest,
                         ::testing::Values(WeightLayout::kInProj,
                                           WeightLayout::kSeparateProjWeights,
                                           WeightLayout::kSeparateLinears,
                                           WeightLayout::kPerHeadLinears),
                         [](const ::testing::TestParamInfo<WeightLayout>& info) {
                           return std::string(WeightLayoutName(info.param));
                         });

// --- Layout-specific shapes --------------------------------------------------

// kdim and vdim differ from embed_dim: only layouts with separate key and
// value weights can hold them.
TEST(PackWeightsTest, SeparateLayoutsHoldDistinctKdimAndVdim) {
  AttentionDims d = BaseDims();
  d.kdim = 10;
  d.vdim = 14;
  const PackedWeights w = RandomWeights(d, 17);
  for (WeightLayout layout : {WeightLayout::kSeparateProjWeights, WeightLayout::kSeparateLinears,
                              WeightLayout::kPerHeadLinears}) {
    SCOPED_TRACE(WeightLayoutName(layout));
    absl::StatusOr<PackedWeights> packed =
        PackWeights(d, ConfigFor(d), WeightsAsTensors(d, w, layout));
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_EQ(packed->layout, layout);
    ExpectSameWeights(*packed, w);
    EXPECT_EQ(packed->w_k.size(), 24u * 10u);
    EXPECT_EQ(packed->w_v.size(), 24u * 14u);
  }
}

// The einsum variant: per-head linears whose q/k and v widths differ.
TEST(PackWeightsTest, PerHeadLayoutWithDistinctHeadDims) {
  AttentionDims d = BaseDims();
  d.qk_head_dim = 5;
  d.v_head_dim = 3;
  const PackedWeights w = RandomWeights(d, 19);
  absl::StatusOr<PackedWeights> packed =
      PackWeights(d, ConfigFor(d), WeightsAsTensors(d, w, WeightLayout::kPerHeadLinears));
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->layout, WeightLayout::kPerHeadLinears);
  ExpectSameWeights(*packed, w);
  EXPECT_EQ(packed->w_q.size(), 4u * 5u * 24u);
  EXPECT_EQ(packed->w_v.size(), 4u * 3u * 24u);
  EXPECT_EQ(packed->w_o.size(), 24u * 4u * 3u);
}

// A tensor of `shape` whose element i is `start + i`.
Tensor Iota(std::vector<int64_t> shape, float start) {
  Tensor t(DType::kF32, std::move(shape));
  std::iota(t.f32(), t.f32() + t.num_elements(), start);
  return t;
}

std::vector<float> IotaVector(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

std::vector<float> Concat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Written by hand (not with test_models.h): head 0's rows come before head
// 1's, each head's rows in order.
TEST(PackWeightsTest, PerHeadLayoutStacksHeadsInOrder) {
  const AttentionDims d{
      .embed_dim = 4, .num_heads = 2, .kdim = 4, .vdim = 4, .qk_head_dim = 3, .v_head_dim = 1};
  TensorMap t;
  for (int i = 0; i < 2; ++i) {
    const float base = 1000.0f * i;
    t[absl::StrCat("q_proj.", i, ".weight")] = Iota({3, 4}, base + 100);
    t[absl::StrCat("q_proj.", i, ".bias")] = Iota({3}, base + 200);
    t[absl::StrCat("k_proj.", i, ".weight")] = Iota({3, 4}, base + 300);
    t[absl::StrCat("k_proj.", i, ".bias")] = Iota({3}, base + 400);
    t[absl::StrCat("v_proj.", i, ".weight")] = Iota({1, 4}, base + 500);
    t[absl::StrCat("v_proj.", i, ".bias")] = Iota({1}, base + 600);
  }
  t["out_proj.weight"] = Iota({4, 2}, 700);
  t["out_proj.bias"] = Iota({4}, 800);
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), t);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->w_q, Concat(IotaVector(12, 100), IotaVector(12, 1100)));
  EXPECT_EQ(packed->b_q, Concat(IotaVector(3, 200), IotaVector(3, 1200)));
  EXPECT_EQ(packed->w_k, Concat(IotaVector(12, 300), IotaVector(12, 1300)));
  EXPECT_EQ(packed->b_k, Concat(IotaVector(3, 400), IotaVector(3, 1400)));
  EXPECT_EQ(packed->w_v, Concat(IotaVector(4, 500), IotaVector(4, 1500)));
  EXPECT_EQ(packed->b_v, Concat(IotaVector(1, 600), IotaVector(1, 1600)));
  EXPECT_EQ(packed->w_o, IotaVector(8, 700));
  EXPECT_EQ(packed->b_o, IotaVector(4, 800));
}

// Written by hand: in_proj_weight rows are [q; k; v], in_proj_bias likewise.
TEST(PackWeightsTest, InProjSplitsRowsIntoQueryKeyValue) {
  const AttentionDims d{
      .embed_dim = 2, .num_heads = 1, .kdim = 2, .vdim = 2, .qk_head_dim = 2, .v_head_dim = 2};
  TensorMap t;
  t["in_proj_weight"] = Iota({6, 2}, 0);
  t["in_proj_bias"] = Iota({6}, 100);
  t["out_proj.weight"] = Iota({2, 2}, 200);
  t["out_proj.bias"] = Iota({2}, 300);
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), t);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->w_q, IotaVector(4, 0));
  EXPECT_EQ(packed->w_k, IotaVector(4, 4));
  EXPECT_EQ(packed->w_v, IotaVector(4, 8));
  EXPECT_EQ(packed->b_q, IotaVector(2, 100));
  EXPECT_EQ(packed->b_k, IotaVector(2, 102));
  EXPECT_EQ(packed->b_v, IotaVector(2, 104));
  EXPECT_EQ(packed->parameter_count, 12 + 6 + 4 + 2);
}

TEST(PackWeightsTest, InProjWithKdimOtherThanEmbedDimIsRejected) {
  const AttentionDims square = BaseDims();
  const TensorMap tensors =
      WeightsAsTensors(square, RandomWeights(square, 1), WeightLayout::kInProj);
  AttentionDims d = square;
  d.kdim = 16;
  ExpectPackError(d, ConfigFor(d), tensors, {"'in_proj_weight'", "kdim"});
}

// --- Names: tensor_names, prefixes, what is reported -------------------------

TEST(PackWeightsTest, TensorNamesMapCanonicalToFileNames) {
  const AttentionDims d = BaseDims();
  const PackedWeights w = RandomWeights(d, 23);
  TensorMap canonical = WeightsAsTensors(d, w, WeightLayout::kInProj);
  const std::vector<std::pair<std::string, std::string>> renames = {
      {"in_proj_weight", "attn.qkv.weight"},
      {"in_proj_bias", "attn.qkv.bias"},
      {"out_proj.weight", "attn.o.weight"},
      {"out_proj.bias", "attn.o.bias"}};
  TensorMap tensors;
  v1::ModelConfig config = ConfigFor(d);
  for (const auto& [from, to] : renames) {
    tensors[to] = canonical.at(from);
    (*config.mutable_tensor_names())[from] = to;
  }
  absl::StatusOr<PackedWeights> packed = PackWeights(d, config, tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->layout, WeightLayout::kInProj);
  ExpectSameWeights(*packed, w);
}

TEST(PackWeightsTest, TensorNamesCanRenameSomeAndLeaveOthers) {
  const AttentionDims d = BaseDims();
  const PackedWeights w = RandomWeights(d, 29);
  TensorMap tensors = WeightsAsTensors(d, w, WeightLayout::kSeparateLinears);
  auto node = tensors.extract("out_proj.weight");
  node.key() = "dense.kernel";
  tensors.insert(std::move(node));
  v1::ModelConfig config = ConfigFor(d);
  (*config.mutable_tensor_names())["out_proj.weight"] = "dense.kernel";
  absl::StatusOr<PackedWeights> packed = PackWeights(d, config, tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ExpectSameWeights(*packed, w);
}

// One tensor of a well-formed checkpoint removed or replaced: packing is
// refused with INVALID_ARGUMENT, naming the tensor and what was expected.
struct BrokenTensor {
  const char* what;
  AttentionDims dims;
  WeightLayout layout;
  std::string name;
  std::optional<Tensor> replacement;  // none: the tensor is removed
  std::vector<std::string> message_parts;
};

AttentionDims WithKdim(int64_t kdim) {
  AttentionDims d = BaseDims();
  d.kdim = kdim;
  return d;
}

AttentionDims WithoutBias() {
  AttentionDims d = BaseDims();
  d.bias = false;
  return d;
}

TEST(PackWeightsTest, AMissingOrMisshapenTensorIsNamedWithWhatWasExpected) {
  const std::vector<BrokenTensor> cases = {
      {"missing, named with the file's name and expected shape",
       BaseDims(),
       WeightLayout::kSeparateLinears,
       "k_proj.weight",
       std::nullopt,
       {"missing", "'k_proj.weight'", "[24, 24]"}},
      {"a missing per-head tensor names the head",
       BaseDims(),
       WeightLayout::kPerHeadLinears,
       "v_proj.2.weight",
       std::nullopt,
       {"'v_proj.2.weight'", "[6, 24]"}},
      {"wrong shape: both shapes",
       BaseDims(),
       WeightLayout::kInProj,
       "out_proj.weight",
       Tensor(DType::kF32, {24, 23}),
       {"'out_proj.weight'", "expected shape [24, 24], got [24, 23]"}},
      {"transposed",
       WithKdim(10),
       WeightLayout::kSeparateProjWeights,
       "k_proj_weight",
       Tensor(DType::kF32, {10, 24}),
       {"'k_proj_weight'", "expected shape [24, 10], got [10, 24]"}},
      {"a BOOL weight",
       BaseDims(),
       WeightLayout::kSeparateLinears,
       "q_proj.weight",
       Tensor(DType::kBool, {24, 24}),
       {"'q_proj.weight'", "BOOL"}},
      {"out_proj.bias with bias false",
       WithoutBias(),
       WeightLayout::kSeparateLinears,
       "out_proj.bias",
       Tensor(DType::kF32, {24}),
       {"'out_proj.bias'", "bias"}},
      {"add_bias_kv requires bias_k",
       FullDims(),
       WeightLayout::kInProj,
       "bias_k",
       std::nullopt,
       {"'bias_k'", "[1, 1, 24]"}},
      {"add_bias_kv requires bias_v",
       FullDims(),
       WeightLayout::kInProj,
       "bias_v",
       std::nullopt,
       {"'bias_v'", "[1, 1, 24]"}},
      {"bias_k of the wrong shape",
       FullDims(),
       WeightLayout::kInProj,
       "bias_k",
       Tensor(DType::kF32, {24}),
       {"'bias_k'", "expected shape [1, 1, 24], got [24]"}},
      {"post_norm requires norm.weight",
       FullDims(),
       WeightLayout::kInProj,
       "norm.weight",
       std::nullopt,
       {"'norm.weight'", "[24]"}},
      {"post_norm requires norm.bias",
       FullDims(),
       WeightLayout::kInProj,
       "norm.bias",
       std::nullopt,
       {"'norm.bias'", "[24]"}},
  };
  for (const BrokenTensor& c : cases) {
    SCOPED_TRACE(c.what);
    TensorMap tensors = WeightsAsTensors(c.dims, RandomWeights(c.dims, 1), c.layout);
    if (c.replacement.has_value()) {
      tensors[c.name] = *c.replacement;
    } else {
      ASSERT_EQ(tensors.erase(c.name), 1u) << "the layout has " << c.name;
    }
    ExpectPackError(c.dims, ConfigFor(c.dims), tensors, c.message_parts);
  }
}

TEST(PackWeightsTest, MissingTensorIsNamedWithItsPrefix) {
  const AttentionDims d = BaseDims();
  TensorMap tensors = WeightsAsTensors(d, RandomWeights(d, 1), WeightLayout::kInProj, "m.");
  tensors.erase("m.out_proj.bias");
  v1::ModelConfig config = ConfigFor(d);
  config.set_tensor_prefix("m.");
  ExpectPackError(d, config, tensors, {"'m.out_proj.bias'", "[24]"});
}

TEST(PackWeightsTest, MissingRenamedTensorIsNamedAsInTheFile) {
  const AttentionDims d = BaseDims();
  TensorMap tensors = WeightsAsTensors(d, RandomWeights(d, 1), WeightLayout::kInProj);
  v1::ModelConfig config = ConfigFor(d);
  (*config.mutable_tensor_names())["out_proj.weight"] = "attn.o.weight";
  ExpectPackError(d, config, tensors, {"'attn.o.weight'", "[24, 24]"});
}

TEST(PackWeightsTest, BiasTensorWithBiasFalseIsRejected) {
  const AttentionDims with_bias = BaseDims();
  const TensorMap tensors =
      WeightsAsTensors(with_bias, RandomWeights(with_bias, 1), WeightLayout::kInProj);
  AttentionDims d = with_bias;
  d.bias = false;
  ExpectPackError(d, ConfigFor(d), tensors, {"'in_proj_bias'", "bias"});
}

TEST(PackWeightsTest, NoRecognisableTensorsListsNamesLookedFor) {
  const AttentionDims d = BaseDims();
  TensorMap tensors;
  tensors["encoder.weight"] = Tensor(DType::kF32, {24, 24});
  v1::ModelConfig config = ConfigFor(d);
  config.set_tensor_prefix("attn.");
  ExpectPackError(d, config, tensors,
                  {"'attn.in_proj_weight'", "'attn.q_proj_weight'", "'attn.q_proj.weight'",
                   "'attn.q_proj.0.weight'"});
}

TEST(PackWeightsTest, EmptyCheckpointIsRejected) {
  const AttentionDims d = BaseDims();
  ExpectPackError(d, ConfigFor(d), TensorMap(), {"'in_proj_weight'"});
}

// --- bias_kv and post_norm ---------------------------------------------------

TEST(PackWeightsTest, WithoutBiasKvAndNormThoseVectorsStayEmpty) {
  const AttentionDims d = BaseDims();
  // The checkpoint has them, the config does not ask for them.
  const TensorMap tensors =
      WeightsAsTensors(FullDims(), RandomWeights(FullDims(), 1), WeightLayout::kInProj);
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_TRUE(packed->bias_k.empty());
  EXPECT_TRUE(packed->bias_v.empty());
  EXPECT_TRUE(packed->norm_weight.empty());
  EXPECT_TRUE(packed->norm_bias.empty());
}

// --- Storage dtypes ----------------------------------------------------------

// `f` rounded to `bits` significant bits, ties to even (normal range only).
float RoundToSignificantBits(float f, int bits) {
  if (f == 0.0f) return f;
  int exponent;
  const float m = std::frexp(f, &exponent);  // f = m * 2^exponent
  return std::ldexp(std::nearbyint(std::ldexp(m, bits)), exponent - bits);
}

// `f` rounded to the nearest f16 value, ties to even; |f| < 65504.
float RoundToHalf(float f) {
  if (std::fabs(f) < std::ldexp(1.0f, -14)) {  // subnormal: multiples of 2^-24
    return std::ldexp(std::nearbyint(std::ldexp(f, 24)), -24);
  }
  return RoundToSignificantBits(f, 11);
}

// The f16 bits of a value that RoundToHalf already rounded.
uint16_t HalfBits(float rounded) {
  const uint16_t sign = std::signbit(rounded) ? 0x8000 : 0;
  const float a = std::fabs(rounded);
  if (a < std::ldexp(1.0f, -14)) {
    return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  }
  int exponent;
  const float m = std::frexp(a, &exponent);  // a = (2m) * 2^(exponent - 1)
  const int mantissa = static_cast<int>(std::ldexp(m, 11)) - 1024;
  return sign | static_cast<uint16_t>(((exponent + 14) << 10) | mantissa);
}

// Every tensor of `tensors` re-stored as `dtype` (F16 or BF16).
TensorMap Restored(const TensorMap& tensors, DType dtype) {
  TensorMap out;
  for (const auto& [name, t] : tensors) {
    Tensor r(dtype, t.shape());
    std::vector<uint16_t> bits;
    for (float x : ToFloatVector(t)) {
      bits.push_back(dtype == DType::kF16 ? HalfBits(RoundToHalf(x)) : FloatToBf16(x));
    }
    std::memcpy(r.raw(), bits.data(), r.num_bytes());
    out[name] = std::move(r);
  }
  return out;
}

std::vector<float> Rounded(const std::vector<float>& v, float (*round)(float)) {
  std::vector<float> out;
  for (float x : v) out.push_back(round(x));
  return out;
}

float RoundToBf16(float f) { return RoundToSignificantBits(f, 8); }

PackedWeights RoundedWeights(const PackedWeights& w, float (*round)(float)) {
  PackedWeights r = w;
  for (std::vector<float>* v : {&r.w_q, &r.w_k, &r.w_v, &r.b_q, &r.b_k, &r.b_v, &r.w_o, &r.b_o,
                                &r.bias_k, &r.bias_v, &r.norm_weight, &r.norm_bias}) {
    *v = Rounded(*v, round);
  }
  return r;
}

TEST(PackWeightsTest, HalfTestHelperMatchesKnownEncodings) {
  EXPECT_EQ(HalfBits(RoundToHalf(1.0f)), 0x3C00);
  EXPECT_EQ(HalfBits(RoundToHalf(-2.0f)), 0xC000);
  EXPECT_EQ(HalfBits(RoundToHalf(1.0f / 3.0f)), 0x3555);
  EXPECT_EQ(HalfBits(RoundToHalf(std::ldexp(1.0f, -24))), 0x0001);
}

TEST(PackWeightsTest, F16WeightsAreConverted) {
  const AttentionDims d = FullDims();
  const PackedWeights w = RandomWeights(d, 31);
  const TensorMap tensors =
      Restored(WeightsAsTensors(d, w, WeightLayout::kSeparateLinears), DType::kF16);
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const PackedWeights want = RoundedWeights(w, RoundToHalf);
  ASSERT_NE(want.w_q, w.w_q);  // the rounding is visible
  ExpectSameWeights(*packed, want);
}

TEST(PackWeightsTest, Bf16WeightsAreConverted) {
  const AttentionDims d = FullDims();
  const PackedWeights w = RandomWeights(d, 37);
  const TensorMap tensors = Restored(WeightsAsTensors(d, w, WeightLayout::kInProj), DType::kBF16);
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const PackedWeights want = RoundedWeights(w, RoundToBf16);
  ASSERT_NE(want.w_q, w.w_q);
  ExpectSameWeights(*packed, want);
}

TEST(PackWeightsTest, MixedStorageDtypesAreConverted) {
  const AttentionDims d = BaseDims();
  const PackedWeights w = RandomWeights(d, 41);
  TensorMap tensors = WeightsAsTensors(d, w, WeightLayout::kInProj);
  TensorMap half = Restored(tensors, DType::kF16);
  tensors["out_proj.weight"] = half.at("out_proj.weight");
  absl::StatusOr<PackedWeights> packed = PackWeights(d, ConfigFor(d), tensors);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->w_q, w.w_q);
  EXPECT_EQ(packed->w_o, Rounded(w.w_o, RoundToHalf));
}

}  // namespace
}  // namespace mha
