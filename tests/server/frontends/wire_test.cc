// The wire reader and writer (server/frontends/wire_reader.h,
// wire_writer.h) against protobuf's own parser, and requests decoded from
// tensors received in pieces against the same requests in one piece.
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/request_codec.h"
#include "server/frontends/wire_writer.h"
#include "tests/server/attend_requests.h"
#include "tests/server/frontends/wire_check.h"

namespace mha::server {
namespace {

using testing::CheckReadAgrees;
using testing::CheckWriteRoundTrips;
using testing::SplitInto;

// A request with every tensor field and a query of `len` rows.
v1::AttendRequest FullRequest(int64_t len) {
  v1::AttendRequest r = Request(len, 7, true);
  r.set_model("demo");
  r.set_model_version(3);
  *r.mutable_key() = Wire({1, 4, 24}, std::vector<float>(96, 0.5f));
  *r.mutable_value() = Wire({1, 4, 24}, std::vector<float>(96, -0.25f));
  *r.mutable_attn_mask() = Wire({static_cast<int>(len), 4}, std::vector<float>(len * 4, 0.0f));
  r.set_need_weights(true);
  return r;
}

TEST(WireReaderTest, TensorBytesStayInTheReceivedPiecesAndTheRestParses) {
  const std::string bytes = FullRequest(300).SerializeAsString();
  for (const std::vector<int>& sizes :
       std::vector<std::vector<int>>{{}, {1}, {7}, {4096}, {3, 1000, 1}, {16384}}) {
    const WirePieces pieces = SplitInto(bytes, sizes);
    EXPECT_EQ(CheckReadAgrees(bytes, pieces), "");
    v1::AttendRequest header;
    ReadResult read;
    ASSERT_TRUE(
        ReadWireMessage(pieces, kAttendRequestPayloads, "AttendRequest", header, read).ok());
    EXPECT_FALSE(read.whole);
    ASSERT_EQ(read.payloads.size(), 5u);  // query, key, value, key_padding_mask, attn_mask
    EXPECT_TRUE(header.query().data().empty());
    EXPECT_EQ(header.model(), "demo");
    const int query_path[] = {2, 3};
    const WirePayload* query = LastPayload(read, query_path);
    ASSERT_NE(query, nullptr);
    EXPECT_EQ(query->size, 300 * 24 * 4);
    for (absl::Span<const uint8_t> piece : query->pieces) {  // views, not copies
      EXPECT_GE(reinterpret_cast<const char*>(piece.data()), bytes.data());
      EXPECT_LE(reinterpret_cast<const char*>(piece.data() + piece.size()),
                bytes.data() + bytes.size());
    }
  }
}

TEST(WireReaderTest, EveryOneByteChangeOfASmallRequestIsReadAsProtobufReadsIt) {
  const std::string good = FullRequest(2).SerializeAsString();
  for (size_t at = 0; at < good.size(); ++at) {
    for (uint8_t value : {0x00, 0x01, 0x02, 0x03, 0x04, 0x07, 0x0a, 0x12, 0x1a, 0x7f, 0x80, 0xff}) {
      std::string bytes = good;
      bytes[at] = static_cast<char>(value);
      ASSERT_EQ(CheckReadAgrees(bytes, SplitInto(bytes, {5})), "") << "byte " << at;
      ASSERT_EQ(CheckReadAgrees(bytes.substr(0, at), SplitInto(bytes.substr(0, at), {3})), "")
          << "truncated at " << at;
    }
  }
}

TEST(WireReaderTest, UnusualEncodingsAreLeftToProtobufWhole) {
  // A field repeated (protobuf merges it), a group, a non-minimal tag and a
  // non-minimal length, each before a real query.
  const std::string query = FullRequest(2).SerializeAsString();
  const std::string merged = query + FullRequest(3).SerializeAsString();
  EXPECT_EQ(CheckReadAgrees(merged, SplitInto(merged, {2})), "");
  for (const std::string& prefix :
       {std::string("\x5b\x08\x01\x5c", 4), std::string("\x8a\x00\x00", 3),
        std::string("\x0a\x80\x00", 3), std::string("\x0a\x81\x00z", 4)}) {
    const std::string bytes = prefix + query;
    EXPECT_EQ(CheckReadAgrees(bytes, SplitInto(bytes, {4})), "") << prefix.size();
  }
  v1::AttendRequest header;
  ReadResult read;
  const std::string group = std::string("\x5b\x08\x01\x5c", 4) + query;
  ASSERT_TRUE(
      ReadWireMessage(SplitInto(group, {}), kAttendRequestPayloads, "AttendRequest", header, read)
          .ok());
  EXPECT_TRUE(read.whole);
  EXPECT_FALSE(header.query().data().empty());
}

TEST(WireReaderTest, MalformedMessagesAreInvalidArgument) {
  for (const std::string& bytes : {std::string("\x12\x05\x01", 3), std::string("\x12", 1),
                                   std::string("\x0f", 1), std::string("\x0a\x02\xff\xfe", 4)}) {
    v1::AttendRequest header;
    ReadResult read;
    const absl::Status s = ReadWireMessage(SplitInto(bytes, {1}), kAttendRequestPayloads,
                                           "AttendRequest", header, read);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(CheckReadAgrees(bytes, SplitInto(bytes, {1})), "");
  }
}

TEST(WireReaderTest, RawInputContentsKeepTheirPlaces) {
  inference::ModelInferRequest r;
  r.set_model_name("demo");
  r.add_inputs()->set_name("query");
  r.add_raw_input_contents(std::string(1000, 'a'));
  r.add_raw_input_contents("");
  r.add_raw_input_contents(std::string(70000, 'c'));
  const std::string bytes = r.SerializeAsString();
  const WirePieces pieces = SplitInto(bytes, {999});
  EXPECT_EQ(CheckReadAgrees(bytes, pieces), "");
  inference::ModelInferRequest header;
  ReadResult read;
  ASSERT_TRUE(
      ReadWireMessage(pieces, kInferRequestPayloads, "ModelInferRequest", header, read).ok());
  EXPECT_EQ(header.raw_input_contents_size(), 3);
  ASSERT_EQ(read.payloads.size(), 3u);
  EXPECT_EQ(read.payloads[2].size, 70000);
}

TEST(WireWriterTest, ResponsesWrittenAroundTheirPayloadsParseToTheSameMessage) {
  v1::AttendResponse attend;
  attend.set_model("demo");
  attend.set_model_version(2);
  *attend.mutable_output() = Wire({1, 300, 24}, std::vector<float>(300 * 24, 1.5f));
  *attend.mutable_attn_weights() = Wire({1, 300, 300}, std::vector<float>(90000, 0.25f));
  EXPECT_EQ(CheckWriteRoundTrips(attend.SerializeAsString()), "");
  attend.mutable_output()->clear_data();  // an empty payload
  EXPECT_EQ(CheckWriteRoundTrips(attend.SerializeAsString()), "");
  inference::ModelInferResponse infer;
  infer.set_model_name("demo");
  infer.add_outputs()->set_name("output");
  infer.add_raw_output_contents(std::string(200000, 'x'));
  infer.add_raw_output_contents("");
  EXPECT_EQ(CheckWriteRoundTrips(infer.SerializeAsString()), "");
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
    const WirePieces query_pieces = SplitInto(query, {3, 1, 5});
    const WirePieces mask_pieces = SplitInto(mask, {1});
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
    // One byte short, in pieces: the size is checked as in one piece.
    const WirePieces short_pieces = SplitInto(query.substr(0, query.size() - 1), {7});
    received[0] = &short_pieces;
    EXPECT_EQ(DecodeAttendRequest(request, Dims(), {}, received).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace mha::server
