// Decoding mha.v1 Attend requests into the engine's requests, and encoding
// results in the wire's dtypes.
#include "server/frontends/common/request_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/wire_dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/proto/wire/wire_check.h"
#include "tests/server/attend_requests.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;
using wire::testing::SplitInto;

absl::Status DecodeError(const v1::AttendRequest& r) {
  return DecodeAttendRequest(r, Dims(), RequestLimits{}).status();
}

TEST(RequestCodecTest, DecodesAValidRequestAsViewsOfItsBytes) {
  const v1::AttendRequest request = Request(5, 1, true);
  absl::StatusOr<AttentionRequest> d = DecodeAttendRequest(request, Dims(), {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kind(), AttentionKind::kSelf);
  EXPECT_EQ(d->tokens(), 10);
  EXPECT_EQ(d->output_shape(), (std::vector<int64_t>{1, 5, 24}));
  EXPECT_EQ(d->output_dtype(), DType::kF32);
  EXPECT_TRUE(d->batch().key_padding_mask.present());
  EXPECT_EQ(static_cast<const void*>(d->batch().query.data()), request.query().data().data());
  EXPECT_EQ(d->batch().key_padding_mask.data, request.key_padding_mask().data().data());
}

// Each is INVALID_ARGUMENT, its message naming the field.
TEST(RequestCodecTest, RejectsEachMalformedFieldWithItsName) {
  struct Case {
    const char* what;
    std::function<void(v1::AttendRequest&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no query", [](auto& r) { r.clear_query(); }, "query: required"},
      {"bytes", [](auto& r) { r.mutable_query()->mutable_data()->pop_back(); },
       "query: data has 479 bytes"},
      {"last dim",
       [](auto& r) {
         *r.mutable_query() = Wire({1, 6, 20}, std::vector<float>(120));
       },
       "query: expected last dimension 24, got 20"},
      {"rank", [](auto& r) { *r.mutable_query() = Wire({120}, std::vector<float>(120)); },
       "query: expected rank 3"},
      {"negative", [](auto& r) { r.mutable_query()->set_shape(1, -5); },
       "query: negative dimension"},
      {"overflow",
       [](auto& r) {
         r.mutable_query()->clear_shape();
         for (int64_t d : {int64_t{1} << 40, int64_t{1} << 40, int64_t{24}})
           r.mutable_query()->add_shape(d);
       },
       "overflows int64"},
      {"dtype", [](auto& r) { r.mutable_query()->set_dtype(static_cast<v1::DataType>(99)); },
       "query: dtype 99"},
      {"bool query",
       [](auto& r) {
         *r.mutable_query() = BoolWire({1, 2, 24}, std::vector<uint8_t>(48));
       },
       "query: dtype DATA_TYPE_BOOL"},
      {"nan",
       [](auto& r) {
         float nan = std::numeric_limits<float>::quiet_NaN();
         std::memcpy(r.mutable_query()->mutable_data()->data() + 8, &nan, 4);
       },
       "query: element 2 is nan"},
      {"value without key", [](auto& r) { *r.mutable_value() = r.query(); },
       "value: given without key"},
      {"empty key",  // would read as self-attention (found by fuzz_request)
       [](auto& r) {
         *r.mutable_key() = Wire({1, 0, 24}, {});
         *r.mutable_value() = Wire({1, 0, 24}, {});
       },
       "key: shape [1, 0, 24] has no tokens"},
      {"mask shape",
       [](auto& r) {
         *r.mutable_key_padding_mask() = BoolWire({1, 4}, {0, 0, 0, 0});
       },
       "key_padding_mask: expected shape [1, 5]"},
      {"mask dtype",
       [](auto& r) {
         *r.mutable_attn_mask() = Wire({5, 5}, std::vector<float>(25));
         r.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
       },
       "attn_mask: dtype DATA_TYPE_UNSPECIFIED is not one of"},
      {"attn mask shape",
       [](auto& r) {
         *r.mutable_attn_mask() = BoolWire({5, 4}, std::vector<uint8_t>(20));
       },
       "attn_mask: expected shape [5, 5] or [3, 5, 5]"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest r = Request(5, 2);
    c.edit(r);
    const absl::Status s = DecodeError(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.what;
  }
}

TEST(RequestCodecTest, TooManyTokensIsResourceExhausted) {
  const v1::AttendRequest request = Request(8, 1);
  absl::StatusOr<AttentionRequest> d =
      DecodeAttendRequest(request, Dims(), RequestLimits{.max_tokens = 10});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RequestCodecTest, EncodesHalfTypesThatDecodeBack) {
  const std::vector<float> values = {1.0f, -2.5f, 0.333f, 65504.0f, 1e-6f, 0.0f};
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    v1::Tensor wire;
    EncodeTensor(values, {6}, dtype, &wire);
    EXPECT_EQ(wire.dtype(), ToWireDType(dtype));
    ASSERT_EQ(wire.data().size(), 12u);
    std::vector<float> got(6);
    ConvertToFloat(dtype, reinterpret_cast<const uint8_t*>(wire.data().data()), 6, got.data());
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_NEAR(got[i], values[i], std::fabs(values[i]) * 1e-2 + 1e-7)
          << i << " " << DTypeName(dtype);
    }
  }
}

// A request whose tensors arrive in pieces decodes to the values of the
// same request in one piece: F32 gathered, F16 and BF16 converted across
// pieces that split their elements, BOOL masks gathered.
TEST(WireDecodeTest, TensorsInPiecesDecodeAsInOnePiece) {
  std::mt19937 gen(3);
  std::normal_distribution<float> dist;
  std::vector<float> values(5 * 24);
  for (float& v : values) v = dist(gen);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    v1::AttendRequest request = Request(5, 1, true);
    EncodeTensor(values, {1, 5, 24}, dtype, request.mutable_query());
    const std::string& query = request.query().data();
    const std::string& mask = request.key_padding_mask().data();
    const ReceivedBytes query_pieces = SplitInto(query, {3, 1, 5});
    const ReceivedBytes mask_pieces = SplitInto(mask, {1});
    AttendReceived received{};
    received[0] = &query_pieces;
    received[3] = &mask_pieces;
    absl::StatusOr<AttentionRequest> whole = DecodeAttendRequest(request, Dims(), {});
    absl::StatusOr<AttentionRequest> pieces = DecodeAttendRequest(request, Dims(), {}, received);
    ASSERT_TRUE(whole.ok() && pieces.ok()) << pieces.status();
    EXPECT_EQ(pieces->output_dtype(), dtype);
    ASSERT_EQ(whole->batch().query.size(), pieces->batch().query.size());
    for (size_t i = 0; i < whole->batch().query.size(); ++i) {
      ASSERT_EQ(whole->batch().query[i], pieces->batch().query[i]) << i;
    }
    const MaskView& a = whole->batch().key_padding_mask;
    const MaskView& b = pieces->batch().key_padding_mask;
    ASSERT_EQ(a.num_elements, b.num_elements);
    EXPECT_EQ(std::memcmp(a.data, b.data, a.num_elements), 0);
    // A non-finite value is found at its index, in whichever piece.
    std::vector<float> bad = values;
    bad[77] = std::numeric_limits<float>::infinity();
    v1::AttendRequest bad_request = request;
    EncodeTensor(bad, {1, 5, 24}, dtype, bad_request.mutable_query());
    const ReceivedBytes bad_pieces = SplitInto(bad_request.query().data(), {3, 1, 5});
    AttendReceived bad_received{};
    bad_received[0] = &bad_pieces;
    EXPECT_EQ(DecodeAttendRequest(bad_request, Dims(), {}, bad_received).status().message(),
              "query: element 77 is inf, expected a finite number");
    // One byte short, in pieces: the size is checked as in one piece.
    const ReceivedBytes short_pieces = SplitInto(query.substr(0, query.size() - 1), {7});
    received[0] = &short_pieces;
    EXPECT_EQ(DecodeAttendRequest(request, Dims(), {}, received).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace mha::server
