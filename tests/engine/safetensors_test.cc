// Tests of engine/safetensors.h and engine/tensor.h (dtype.h's are dtype_test.cc). Files
// are assembled byte by byte so every malformed case is explicit.
#include "engine/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/output_check.h"
#include "engine/tensor.h"
#include "engine/threads.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string LengthPrefix(uint64_t length) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  return out;
}

// The 8-byte little-endian length, the JSON header text, then the data.
std::string File(const std::string& header, const std::string& data = "") {
  return LengthPrefix(header.size()) + header + data;
}

// The bytes of `values` in host (little-endian) order.
template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A tensor of `dtype` and `shape` holding `bytes` verbatim.
Tensor TensorFromBytes(DType dtype, std::vector<int64_t> shape, const std::string& bytes) {
  Tensor t(dtype, std::move(shape));
  EXPECT_EQ(t.num_bytes(), bytes.size());
  if (!bytes.empty()) {
    std::memcpy(t.raw(), bytes.data(), std::min(bytes.size(), t.num_bytes()));
  }
  return t;
}

std::string TensorBytes(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.raw()), t.num_bytes());
}

void ExpectSameTensors(const TensorMap& got, const TensorMap& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    EXPECT_EQ(it->second.dtype(), t.dtype()) << name;
    EXPECT_EQ(it->second.shape(), t.shape()) << name;
    EXPECT_EQ(TensorBytes(it->second), TensorBytes(t)) << name;
  }
}

// One tensor of each dtype, a scalar and a 0-element tensor.
TensorMap MixedTensors() {
  TensorMap m;
  m["f32"] =
      TensorFromBytes(DType::kF32, {2, 3}, Bytes<float>({1.5f, -2.0f, 0.0f, 3.25f, 1e-3f, 7.0f}));
  m["f16"] = TensorFromBytes(DType::kF16, {4}, Bytes<uint16_t>({0x3C00, 0xC000, 0x0001, 0x7BFF}));
  m["bf16"] =
      TensorFromBytes(DType::kBF16, {2, 2}, Bytes<uint16_t>({0x3F80, 0xC040, 0x0000, 0x7F80}));
  m["bool"] = TensorFromBytes(DType::kBool, {3}, Bytes<uint8_t>({1, 0, 1}));
  m["empty"] = TensorFromBytes(DType::kF32, {0, 5}, "");
  m["scalar"] = TensorFromBytes(DType::kF32, {}, Bytes<float>({42.0f}));
  return m;
}

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "safetensors_test_", name);
}

// --- tensor.h ----------------------------------------------------------------

TEST(NumElementsTest, MultipliesDimensions) {
  EXPECT_EQ(*NumElements({2, 3, 4}), 24);
  EXPECT_EQ(*NumElements({}), 1);
  EXPECT_EQ(*NumElements({7, 0, 5}), 0);
}

TEST(NumElementsTest, ZeroDimensionBeforeHugeOnesIsZero) {
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(*NumElements({0, big, big}), 0);
}

TEST(NumElementsTest, LargestInt64IsAccepted) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(*NumElements({max, 1}), max);
}

TEST(NumElementsTest, NegativeDimensionIsInvalid) {
  absl::StatusOr<int64_t> n = NumElements({2, -1, 3});
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("negative"));
}

TEST(NumElementsTest, OverflowingProductIsInvalid) {
  const int64_t big = int64_t{1} << 32;
  absl::StatusOr<int64_t> n = NumElements({big, big});
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("overflow"));
}

TEST(NumElementsTest, OverflowOnlyInTheLastFactorIsInvalid) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(NumElements({3, max / 2}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ToFloatVectorTest, ConvertsF16) {
  Tensor t = TensorFromBytes(DType::kF16, {4}, Bytes<uint16_t>({0x3C00, 0xC000, 0x3800, 0x0001}));
  EXPECT_THAT(ToFloatVector(t), ElementsAre(1.0f, -2.0f, 0.5f, std::ldexp(1.0f, -24)));
}

TEST(ToFloatVectorTest, ConvertsBf16) {
  Tensor t =
      TensorFromBytes(DType::kBF16, {2, 2}, Bytes<uint16_t>({0x3F80, 0xC040, 0x3F00, 0x0000}));
  EXPECT_THAT(ToFloatVector(t), ElementsAre(1.0f, -3.0f, 0.5f, 0.0f));
}

TEST(ToFloatVectorTest, ConvertsBoolToZeroAndOne) {
  Tensor t = TensorFromBytes(DType::kBool, {4}, Bytes<uint8_t>({0, 1, 7, 0}));
  EXPECT_THAT(ToFloatVector(t), ElementsAre(0.0f, 1.0f, 1.0f, 0.0f));
}

TEST(ToFloatVectorTest, CopiesF32) {
  Tensor t = MakeF32Tensor({3}, {1.0f, -0.25f, 8.0f});
  EXPECT_THAT(ToFloatVector(t), ElementsAre(1.0f, -0.25f, 8.0f));
}

// --- Round trips -------------------------------------------------------------

TEST(FirstNonFiniteTest, FindsTheFirstNanOrInfinityAtAnyPosition) {
  const float special[] = {
      std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
  // Positions in the first chunk, at a chunk's edges, and in a short tail.
  for (const size_t size : {size_t{1}, size_t{37}, size_t{4096}, size_t{10000}}) {
    for (const size_t at : {size_t{0}, size_t{7}, size_t{4095}, size_t{4096}, size_t{9999}}) {
      if (at >= size) continue;
      for (const float bad : special) {
        std::vector<float> values(size, std::numeric_limits<float>::max());
        values[at] = bad;
        if (at + 1 < size) values[size - 1] = bad;  // a later one is not the first
        EXPECT_EQ(FirstNonFinite(values), static_cast<int64_t>(at)) << size << " " << at;
      }
    }
  }
}

TEST(FirstNonFiniteTest, FiniteExtremesAreFinite) {
  std::vector<float> values(5000);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = i % 3 == 0   ? -std::numeric_limits<float>::max()
                : i % 3 == 1 ? std::numeric_limits<float>::denorm_min()
                             : -0.0f;
  }
  EXPECT_EQ(FirstNonFinite(values), -1);
  EXPECT_EQ(FirstNonFinite({}), -1);
}

// The conversion a worker makes of a large FP16 or BF16 output, in the pass
// that checks it: the same bytes as ConvertFromFloat, and false for a NaN or
// an infinity in any chunk (finite values beyond FP16's range are still
// finite: they become +-inf, as ConvertFromFloat makes them).
TEST(ConvertFiniteFromFloatTest, ConvertsAsConvertFromFloatAndFindsNonFiniteValues) {
  for (const DType dtype : {DType::kF16, DType::kBF16}) {
    for (const size_t size : {size_t{0}, size_t{37}, size_t{4096}, size_t{10000}}) {
      std::vector<float> values(size);
      for (size_t i = 0; i < size; ++i) {
        values[i] = i % 5 == 0 ? 1e5f * static_cast<float>(i % 3) - 1e5f
                               : static_cast<float>(i) * 0.37f - 1000.0f;
      }
      std::vector<uint8_t> want(size * 2), got(size * 2, 0xab);
      ConvertFromFloat(values.data(), static_cast<int64_t>(size), dtype, want.data());
      EXPECT_TRUE(ConvertFiniteFromFloat(values, dtype, got.data())) << size;
      EXPECT_EQ(got, want) << size;
      for (const size_t at : {size_t{0}, size_t{4095}, size_t{4096}, size_t{9999}}) {
        if (at >= size) continue;
        for (const float bad :
             {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
          std::vector<float> poisoned = values;
          poisoned[at] = bad;
          EXPECT_FALSE(ConvertFiniteFromFloat(poisoned, dtype, got.data())) << size << " " << at;
        }
      }
    }
  }
}

// The same, shared out across two threads from 256 KiB (each converting its
// own part), and the f32 check alone: the same bytes, and a NaN or an
// infinity found in either part, at its ends too.
TEST(ConvertFiniteFromFloatTest, SharedAcrossThreadsConvertsAndChecksEveryPart) {
  SetComputeThreads(2);
  for (const DType dtype : {DType::kF16, DType::kBF16}) {
    for (const size_t size :
         {size_t{0}, size_t{37}, size_t{65535}, size_t{65536}, size_t{65573}, size_t{300001}}) {
      std::vector<float> values(size);
      for (size_t i = 0; i < size; ++i) values[i] = static_cast<float>(i % 1999) * 0.37f - 300.0f;
      std::vector<uint8_t> want(size * 2), got(size * 2, 0xab);
      ConvertFromFloat(values.data(), static_cast<int64_t>(size), dtype, want.data());
      EXPECT_TRUE(ConvertFiniteAcrossThreads(values, dtype, got.data())) << size;
      EXPECT_EQ(got, want) << size;
      EXPECT_TRUE(AllFiniteAcrossThreads(values)) << size;
      for (const size_t at : {size_t{0}, size / 2 - 1, size / 2, size / 2 + 1, size - 1}) {
        if (at >= size) continue;
        for (const float bad :
             {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
          std::vector<float> poisoned = values;
          poisoned[at] = bad;
          EXPECT_FALSE(ConvertFiniteAcrossThreads(poisoned, dtype, got.data()))
              << size << " " << at;
          EXPECT_FALSE(AllFiniteAcrossThreads(poisoned)) << size << " " << at;
        }
      }
    }
  }
}

TEST(SafetensorsRoundTripTest, AllDtypesAndAnEmptyTensorSurvive) {
  const TensorMap tensors = MixedTensors();
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(SerializeSafetensors(tensors));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameTensors(*parsed, tensors);
}

TEST(SafetensorsRoundTripTest, EmptyMapSurvives) {
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(SerializeSafetensors({}));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->empty());
}

// Many tensors, every other one empty: an empty tensor shares its offset with
// the next tensor, which must not count as an overlap.
TEST(SafetensorsRoundTripTest, ManyTensorsWithEmptyOnesSurvive) {
  TensorMap tensors;
  for (int i = 0; i < 40; ++i) {
    const std::string name = absl::StrCat("t", i < 10 ? "0" : "", i);
    if (i % 2 == 0) {
      tensors[name] = TensorFromBytes(DType::kF32, {0}, "");
    } else {
      tensors[name] = MakeF32Tensor({2}, {float(i), -float(i)});
    }
  }
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(SerializeSafetensors(tensors));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameTensors(*parsed, tensors);
}

TEST(SafetensorsRoundTripTest, DataIsPackedInNameOrderAtTheEnd) {
  TensorMap tensors;
  tensors["b"] = MakeF32Tensor({2}, {3.0f, 4.0f});
  tensors["a"] = MakeF32Tensor({1}, {1.0f});
  const std::string bytes = SerializeSafetensors(tensors);
  const std::string data = Bytes<float>({1.0f, 3.0f, 4.0f});
  ASSERT_GE(bytes.size(), 8 + data.size());
  EXPECT_EQ(bytes.substr(bytes.size() - data.size()), data);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  }
  EXPECT_EQ(8 + header_len + data.size(), bytes.size());
}

TEST(SafetensorsRoundTripTest, WriteThenReadAFile) {
  const TensorMap tensors = MixedTensors();
  const std::string path = TempPath("round_trip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<TensorMap> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameTensors(*read, tensors);
}

// --- Parsing well-formed files written by hand -------------------------------

TEST(ParseSafetensorsTest, ReadsHandWrittenTensors) {
  const std::string file = File(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("h":{"dtype":"F16","shape":[1,2],"data_offsets":[8,12]}})",
                                Bytes<float>({2.5f, -1.0f}) + Bytes<uint16_t>({0x3C00, 0xB800}));
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 2u);
  const Tensor& w = parsed->at("w");
  EXPECT_EQ(w.dtype(), DType::kF32);
  EXPECT_THAT(w.shape(), ElementsAre(2));
  EXPECT_THAT(ToFloatVector(w), ElementsAre(2.5f, -1.0f));
  const Tensor& h = parsed->at("h");
  EXPECT_EQ(h.dtype(), DType::kF16);
  EXPECT_THAT(h.shape(), ElementsAre(1, 2));
  EXPECT_THAT(ToFloatVector(h), ElementsAre(1.0f, -0.5f));
}

TEST(ParseSafetensorsTest, MetadataEntryIsIgnored) {
  const std::string file = File(R"({"__metadata__":{"format":"pt"},)"
                                R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                Bytes<float>({1.0f}));
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->size(), 1u);
  EXPECT_EQ(parsed->count("w"), 1u);
  EXPECT_EQ(parsed->count("__metadata__"), 0u);
}

TEST(ParseSafetensorsTest, TrailingSpacesInHeaderAreAccepted) {
  const std::string file = File(R"({"w":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}}     )",
                                Bytes<uint8_t>({1, 0}));
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(ToFloatVector(parsed->at("w")), ElementsAre(1.0f, 0.0f));
}

// An empty tensor's byte range is empty: it overlaps nothing, even when it
// starts where another tensor starts (the reference implementation accepts
// this, sorting by (begin, end)).
TEST(ParseSafetensorsTest, EmptyTensorAtTheStartOfAnotherIsNotAnOverlap) {
  const std::string file = File(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                R"("b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
                                Bytes<float>({1.0f}));
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->size(), 2u);
}

// --- File-level errors (no tensor to name yet) -------------------------------

TEST(ParseSafetensorsTest, FileShorterThanEightBytesIsInvalid) {
  absl::StatusOr<TensorMap> parsed = ParseSafetensors("abc");
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("3 bytes"));
}

TEST(ParseSafetensorsTest, EmptyFileIsInvalid) {
  EXPECT_EQ(ParseSafetensors("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseSafetensorsTest, HeaderLengthBeyondTheFileIsInvalid) {
  const std::string file = LengthPrefix(100) + R"({"a":1})";
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("header length 100"));
}

TEST(ParseSafetensorsTest, FourGibHeaderLengthOnASmallFileIsInvalid) {
  const std::string file = LengthPrefix(uint64_t{0x100000000}) + "{}";
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(file);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("4294967296"));
}

TEST(ParseSafetensorsTest, HeaderLengthNearUint64MaxIsInvalid) {
  const std::string file = LengthPrefix(std::numeric_limits<uint64_t>::max()) + "{}";
  EXPECT_EQ(ParseSafetensors(file).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseSafetensorsTest, HeaderThatIsNotJsonIsInvalid) {
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(File("{not json"));
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("JSON"));
}

TEST(ParseSafetensorsTest, HeaderThatIsNotAnObjectIsInvalid) {
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(File("[1, 2, 3]"));
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("JSON object"));
}

// --- Per-tensor errors: each names the tensor --------------------------------

// The data of one F32 tensor of shape [1].
std::string FourBytes() { return Bytes<float>({1.0f}); }

// A header the parser must refuse, the data after it, and the words its
// INVALID_ARGUMENT message must contain.
struct InvalidFile {
  const char* name;
  std::vector<std::string> parts;
  std::string header;
  std::string data = FourBytes();
};

void PrintTo(const InvalidFile& bad, std::ostream* os) { *os << bad.header; }

std::vector<InvalidFile> InvalidFiles() {
  return {
      {"EntryThatIsNotAnObjectNamesTheTensor", {"'w'"}, R"({"w":[1,2]})", ""},
      {"MissingDtypeNamesTheTensor",
       {"'w'", "dtype"},
       R"({"w":{"shape":[1],"data_offsets":[0,4]}})"},
      {"MissingShapeNamesTheTensor",
       {"'w'", "shape"},
       R"({"w":{"dtype":"F32","data_offsets":[0,4]}})"},
      {"MissingDataOffsetsNamesTheTensor",
       {"'w'", "data_offsets"},
       R"({"w":{"dtype":"F32","shape":[1]}})"},
      {"DataOffsetsWithOneEntryNamesTheTensor",
       {"'w'", "data_offsets"},
       R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4]}})"},
      {"NegativeDataOffsetNamesTheTensor",
       {"'w'", "data_offsets"},
       R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})"},
      {"UnknownDtypeNamesTheTensorAndTheDtype",
       {"'w'", "I64"},
       R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})",
       Bytes<int64_t>({7})},
      {"DataOffsetsPastTheDataNamesTheTensor",
       {"'w'", "data_offsets"},
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"},
      {"HugeDataOffsetsNamesTheTensor",
       {"'w'"},
       R"({"w":{"dtype":"F32","shape":[1],)"
       R"("data_offsets":[18446744073709551612,18446744073709551615]}})"},
      {"BeginAfterEndNamesTheTensor",
       {"'w'", "data_offsets"},
       R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})"},
      {"SpanShorterThanDtypeTimesShapeNamesTheTensor",
       {"'w'", "[2]"},
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
       Bytes<float>({1.0f, 2.0f})},
      {"SpanLongerThanDtypeTimesShapeNamesTheTensor",
       {"'w'", "F16"},
       R"({"w":{"dtype":"F16","shape":[1],"data_offsets":[0,4]}})"},
      {"OverlappingTensorsAreBothNamed",
       {"'a'", "'b'", "overlap"},
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       Bytes<float>({1.0f, 2.0f, 3.0f})},
      {"IdenticalRangesOverlap",
       {"'a'", "'b'"},
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"},
      {"ShapeThatIsNotAnArrayNamesTheTensor",
       {"'w'", "shape"},
       R"({"w":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})"},
      {"NegativeShapeEntryNamesTheTensor",
       {"'w'", "shape"},
       R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})"},
      {"NonIntegerShapeEntryNamesTheTensor",
       {"'w'", "shape"},
       R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})"},
      {"StringShapeEntryNamesTheTensor",
       {"'w'", "shape"},
       R"({"w":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})"},
      {"ShapeWhoseProductOverflowsNamesTheTensor",
       {"'w'", "overflow"},
       R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
       R"("data_offsets":[0,4]}})"},
      // 2^63 is a valid JSON unsigned integer but no int64 dimension.
      {"ShapeEntryBeyondInt64NamesTheTensor",
       {"'w'"},
       R"({"w":{"dtype":"F32","shape":[9223372036854775808],)"
       R"("data_offsets":[0,4]}})"},
      {"ErrorInASecondTensorNamesThatTensor",
       {"'zbad'"},
       R"({"good":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("zbad":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})"},
  };
}

class InvalidSafetensorsTest : public ::testing::TestWithParam<InvalidFile> {};

TEST_P(InvalidSafetensorsTest, IsInvalidArgumentNamingWhatIsWrong) {
  const InvalidFile& bad = GetParam();
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(File(bad.header, bad.data));
  ASSERT_FALSE(parsed.ok()) << "accepted: " << bad.header;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : bad.parts) {
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(ParseSafetensorsTest, InvalidSafetensorsTest,
                         ::testing::ValuesIn(InvalidFiles()),
                         [](const ::testing::TestParamInfo<InvalidFile>& info) {
                           return std::string(info.param.name);
                         });

// --- Files on disk -----------------------------------------------------------

TEST(ReadSafetensorsTest, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.safetensors");
  absl::StatusOr<TensorMap> read = ReadSafetensors(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(path));
}

TEST(ReadSafetensorsTest, CorruptFileErrorNamesThePathAndTheTensor) {
  const std::string path = TempPath("corrupt.safetensors");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << File(R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", Bytes<int64_t>({1}));
  }
  absl::StatusOr<TensorMap> read = ReadSafetensors(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("'w'"));
}

}  // namespace
}  // namespace mha
