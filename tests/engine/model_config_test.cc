// Tests of engine/model_config.h: parsing config.pbtxt and resolving the
// attention dimensions with their defaults.
#include "engine/model_config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mha/v1/model_config.pb.h"

namespace mha {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

// Parses `text`, failing the test on a parse error.
v1::ModelConfig Parse(const std::string& text) {
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : v1::ModelConfig();
}

// Parses `text`, expecting INVALID_ARGUMENT whose message contains `parts`.
void ExpectParseError(const std::string& text, const std::vector<std::string>& parts) {
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(text);
  ASSERT_FALSE(config.ok()) << "accepted: " << text;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(part));
  }
}

// Resolves `text`, expecting INVALID_ARGUMENT whose message contains `part`.
void ExpectResolveError(const std::string& text, const std::string& part) {
  absl::StatusOr<AttentionDims> dims = ResolveDims(Parse(text));
  ASSERT_FALSE(dims.ok()) << "accepted: " << text;
  EXPECT_EQ(dims.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dims.status().message()), HasSubstr(part));
}

// --- ParseModelConfig --------------------------------------------------------

TEST(ParseModelConfigTest, ReadsEveryField) {
  const v1::ModelConfig c = Parse(R"pb(
    embed_dim: 32
    num_heads: 4
    kdim: 16
    vdim: 20
    qk_head_dim: 6
    v_head_dim: 5
    bias: false
    add_bias_kv: true
    add_zero_attn: true
    compute_dtype: DATA_TYPE_BF16
    post_norm { eps: 1e-6 }
    tensor_prefix: "layers.0.attn."
  )pb");
  EXPECT_EQ(c.embed_dim(), 32);
  EXPECT_EQ(c.num_heads(), 4);
  EXPECT_EQ(c.kdim(), 16);
  EXPECT_EQ(c.vdim(), 20);
  EXPECT_EQ(c.qk_head_dim(), 6);
  EXPECT_EQ(c.v_head_dim(), 5);
  EXPECT_TRUE(c.has_bias());
  EXPECT_FALSE(c.bias());
  EXPECT_TRUE(c.add_bias_kv());
  EXPECT_TRUE(c.add_zero_attn());
  EXPECT_EQ(c.compute_dtype(), v1::DATA_TYPE_BF16);
  EXPECT_DOUBLE_EQ(c.post_norm().eps(), 1e-6);
  EXPECT_EQ(c.tensor_prefix(), "layers.0.attn.");
}

TEST(ParseModelConfigTest, ReadsTensorNamesMap) {
  const v1::ModelConfig c = Parse(R"pb(
    embed_dim: 8
    num_heads: 2
    tensor_names { key: "in_proj_weight" value: "attn.qkv.weight" }
    tensor_names { key: "out_proj.weight" value: "attn.o.weight" }
  )pb");
  EXPECT_THAT(c.tensor_names(), UnorderedElementsAre(Pair("in_proj_weight", "attn.qkv.weight"),
                                                     Pair("out_proj.weight", "attn.o.weight")));
}

TEST(ParseModelConfigTest, EmptyTextIsAnEmptyConfig) {
  absl::StatusOr<v1::ModelConfig> c = ParseModelConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->embed_dim(), 0);
}

TEST(ParseModelConfigTest, SyntaxErrorReportsLineAndColumn) {
  // 'x' is on the second line, 12th column (both counted from 1).
  ExpectParseError("embed_dim: 24\nnum_heads: x\n", {"line 2 column 12"});
}

TEST(ParseModelConfigTest, UnknownFieldIsRejectedByName) {
  ExpectParseError("embed_dim: 24\nnum_heads: 4\ndropout: 0.1\n", {"dropout", "line 3"});
}

TEST(ParseModelConfigTest, UnknownEnumValueIsRejected) {
  ExpectParseError("embed_dim: 24\ncompute_dtype: DATA_TYPE_INT4\n", {"DATA_TYPE_INT4"});
}

// --- ReadModelConfig ---------------------------------------------------------

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(::testing::TempDir(), "model_config_test_", name);
  std::ofstream(path, std::ios::trunc) << text;
  return path;
}

TEST(ReadModelConfigTest, ReadsAFile) {
  const std::string path = WriteTemp("good.pbtxt", "embed_dim: 24\nnum_heads: 3\n");
  absl::StatusOr<v1::ModelConfig> c = ReadModelConfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->embed_dim(), 24);
  EXPECT_EQ(c->num_heads(), 3);
}

TEST(ReadModelConfigTest, MissingFileIsNotFound) {
  const std::string path = absl::StrCat(::testing::TempDir(), "model_config_test_missing.pbtxt");
  absl::StatusOr<v1::ModelConfig> c = ReadModelConfig(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
}

TEST(ReadModelConfigTest, ParseErrorNamesTheFileAndLine) {
  const std::string path = WriteTemp("bad.pbtxt", "embed_dim: 24\nnope: 1\n");
  absl::StatusOr<v1::ModelConfig> c = ReadModelConfig(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("line 2"));
}

// --- ResolveDims: defaults and explicit values -------------------------------

// The fields of `d`, to compare all at once.
auto FieldsOf(const AttentionDims& d) {
  return std::tuple(d.embed_dim, d.num_heads, d.kdim, d.vdim, d.qk_head_dim, d.v_head_dim, d.bias,
                    d.add_bias_kv, d.add_zero_attn, d.bf16, d.kv_cache_bf16, d.kv_cache_int8,
                    d.post_norm, d.norm_eps);
}

// Every field of `actual` as in `expected`.
void ExpectDims(const AttentionDims& actual, const AttentionDims& expected) {
  EXPECT_EQ(FieldsOf(actual), FieldsOf(expected));
}

TEST(ResolveDimsTest, AppliesDefaults) {
  absl::StatusOr<AttentionDims> d = ResolveDims(Parse("embed_dim: 24 num_heads: 4"));
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectDims(
      *d,
      {.embed_dim = 24, .num_heads = 4, .kdim = 24, .vdim = 24, .qk_head_dim = 6, .v_head_dim = 6});
  EXPECT_EQ(d->qk_width(), 24);
  EXPECT_EQ(d->v_width(), 24);
  EXPECT_EQ(d->extra_keys(), 0);
}

TEST(ResolveDimsTest, KeepsExplicitValues) {
  absl::StatusOr<AttentionDims> d = ResolveDims(Parse(R"pb(
    embed_dim: 24
    num_heads: 4
    kdim: 10
    vdim: 12
    qk_head_dim: 8
    v_head_dim: 5
    bias: false
    add_bias_kv: true
    add_zero_attn: true
    compute_dtype: DATA_TYPE_FP32
  )pb"));
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectDims(*d, {.embed_dim = 24,
                  .num_heads = 4,
                  .kdim = 10,
                  .vdim = 12,
                  .qk_head_dim = 8,
                  .v_head_dim = 5,
                  .bias = false,
                  .add_bias_kv = true,
                  .add_zero_attn = true});
  EXPECT_EQ(d->qk_width(), 32);
  EXPECT_EQ(d->v_width(), 20);
  EXPECT_EQ(d->extra_keys(), 2);
}

TEST(ResolveDimsTest, ExplicitBiasTrueIsTrue) {
  absl::StatusOr<AttentionDims> d = ResolveDims(Parse("embed_dim: 8 num_heads: 2 bias: true"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->bias);
}

TEST(ResolveDimsTest, Bf16ComputeDtype) {
  absl::StatusOr<AttentionDims> d =
      ResolveDims(Parse("embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_BF16"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->bf16);
}

// INT8 as a cache type: any model may keep its caches in it.
TEST(ResolveDimsTest, Int8CachesForAnyComputeType) {
  for (const char* compute : {"DATA_TYPE_FP32", "DATA_TYPE_BF16", "DATA_TYPE_INT8"}) {
    absl::StatusOr<AttentionDims> d = ResolveDims(Parse(absl::StrCat(
        "embed_dim: 8 num_heads: 2 compute_dtype: ", compute, " kv_cache_dtype: DATA_TYPE_INT8")));
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(d->kv_cache_int8);
    EXPECT_EQ(d->kv_elem_bytes(), 1) << compute;
  }
  ExpectResolveError("embed_dim: 8 num_heads: 2 kv_cache_dtype: DATA_TYPE_FP16",
                     "kv_cache_dtype must be DATA_TYPE_FP32, DATA_TYPE_BF16 or DATA_TYPE_INT8");
}

// INT8 as a compute type: int8 projections, the core in bf16 (where the
// CPU has it: MhaEngine::Create) unless the caches are asked for in fp32,
// whose core is then fp32; other types are refused by name.
TEST(ResolveDimsTest, Int8ComputeIsInt8ProjectionsAroundABf16OrFp32Core) {
  absl::StatusOr<AttentionDims> d =
      ResolveDims(Parse("embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_INT8"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->int8);
  EXPECT_TRUE(d->bf16);
  EXPECT_EQ(d->kv_elem_bytes(), 2);
  d = ResolveDims(Parse(
      "embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_INT8 kv_cache_dtype: DATA_TYPE_FP32"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->int8);
  EXPECT_FALSE(d->bf16);
  EXPECT_EQ(d->kv_elem_bytes(), 4);
  ExpectResolveError("embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_FP16",
                     "compute_dtype must be DATA_TYPE_FP32, DATA_TYPE_BF16 or DATA_TYPE_INT8, got "
                     "DATA_TYPE_FP16");
}

TEST(ResolveDimsTest, PostNormAbsentIsOff) {
  absl::StatusOr<AttentionDims> d = ResolveDims(Parse("embed_dim: 8 num_heads: 2"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->post_norm);
}

TEST(ResolveDimsTest, EmptyPostNormUsesDefaultEps) {
  absl::StatusOr<AttentionDims> d = ResolveDims(Parse("embed_dim: 8 num_heads: 2 post_norm {}"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->post_norm);
  EXPECT_FLOAT_EQ(d->norm_eps, 1e-5f);
}

TEST(ResolveDimsTest, PostNormWithEps) {
  absl::StatusOr<AttentionDims> d =
      ResolveDims(Parse("embed_dim: 8 num_heads: 2 post_norm { eps: 1e-6 }"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->post_norm);
  EXPECT_FLOAT_EQ(d->norm_eps, 1e-6f);
}

TEST(ResolveDimsTest, LargestDimensionIsAccepted) {
  absl::StatusOr<AttentionDims> d =
      ResolveDims(Parse(absl::StrCat("embed_dim: ", kMaxModelDim, " num_heads: 1")));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->qk_head_dim, kMaxModelDim);
}

TEST(ResolveDimsTest, IndivisibleEmbedDimWithBothHeadDimsIsAccepted) {
  absl::StatusOr<AttentionDims> d =
      ResolveDims(Parse("embed_dim: 10 num_heads: 4 qk_head_dim: 3 v_head_dim: 5"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->qk_width(), 12);
  EXPECT_EQ(d->v_width(), 20);
}

// --- ResolveDims: rejected configs -------------------------------------------

TEST(ResolveDimsTest, ZeroEmbedDimIsRejected) { ExpectResolveError("num_heads: 2", "embed_dim"); }

TEST(ResolveDimsTest, NegativeEmbedDimIsRejected) {
  ExpectResolveError("embed_dim: -8 num_heads: 2", "embed_dim");
}

TEST(ResolveDimsTest, EmbedDimAboveMaximumIsRejected) {
  ExpectResolveError(absl::StrCat("embed_dim: ", kMaxModelDim + 1, " num_heads: 1"), "embed_dim");
}

TEST(ResolveDimsTest, ZeroNumHeadsIsRejected) { ExpectResolveError("embed_dim: 8", "num_heads"); }

TEST(ResolveDimsTest, NegativeKdimIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 kdim: -1", "kdim");
}

TEST(ResolveDimsTest, VdimAboveMaximumIsRejected) {
  ExpectResolveError(absl::StrCat("embed_dim: 8 num_heads: 2 vdim: ", kMaxModelDim + 1), "vdim");
}

TEST(ResolveDimsTest, NegativeHeadDimIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 qk_head_dim: -4", "qk_head_dim");
}

TEST(ResolveDimsTest, IndivisibleEmbedDimIsRejected) {
  ExpectResolveError("embed_dim: 10 num_heads: 4", "divisible");
}

TEST(ResolveDimsTest, IndivisibleEmbedDimWithOnlyQkHeadDimIsRejected) {
  ExpectResolveError("embed_dim: 10 num_heads: 4 qk_head_dim: 3", "divisible");
}

TEST(ResolveDimsTest, IndivisibleEmbedDimWithOnlyVHeadDimIsRejected) {
  ExpectResolveError("embed_dim: 10 num_heads: 4 v_head_dim: 5", "divisible");
}

TEST(ResolveDimsTest, HeadWidthAboveMaximumIsRejected) {
  ExpectResolveError(
      absl::StrCat("embed_dim: 8 num_heads: 2 qk_head_dim: ", kMaxModelDim, " v_head_dim: 4"),
      "head_dim");
}

TEST(ResolveDimsTest, BoolComputeDtypeIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_BOOL", "compute_dtype");
}

TEST(ResolveDimsTest, Fp16ComputeDtypeIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 compute_dtype: DATA_TYPE_FP16", "compute_dtype");
}

TEST(ResolveDimsTest, ZeroEpsIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 post_norm { eps: 0 }", "post_norm.eps");
}

TEST(ResolveDimsTest, NegativeEpsIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 post_norm { eps: -1e-5 }", "post_norm.eps");
}

TEST(ResolveDimsTest, EpsOfOneIsRejected) {
  ExpectResolveError("embed_dim: 8 num_heads: 2 post_norm { eps: 1 }", "post_norm.eps");
}

TEST(ResolveDimsTest, NanEpsIsRejected) {
  v1::ModelConfig c = Parse("embed_dim: 8 num_heads: 2");
  c.mutable_post_norm()->set_eps(std::numeric_limits<double>::quiet_NaN());
  absl::StatusOr<AttentionDims> d = ResolveDims(c);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("post_norm.eps"));
}

}  // namespace
}  // namespace mha
