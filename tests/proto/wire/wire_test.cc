// The wire reader and writer (proto/wire/) against protobuf's own parser.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/large_buffer.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"
#include "mha/v1/attention.pb.h"
#include "tests/proto/wire/wire_check.h"
#include "wire/wire_writer.h"

namespace mha::wire {
namespace {

using testing::CheckReadAgrees;
using testing::CheckWriteRoundTrips;
using testing::SplitInto;

// A tensor of `shape` (FP32), its bytes counting up from `seed`.
v1::Tensor TensorOf(const std::vector<int64_t>& shape, int seed) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FP32);
  int64_t n = 4;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::string data(static_cast<size_t>(n), '\0');
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<char>(seed + i);
  t.set_data(std::move(data));
  return t;
}

// A request with every tensor field and a query of `len` rows.
v1::AttendRequest FullRequest(int64_t len) {
  v1::AttendRequest r;
  r.set_model("demo");
  r.set_model_version(3);
  *r.mutable_query() = TensorOf({1, len, 24}, 1);
  *r.mutable_key() = TensorOf({1, 4, 24}, 2);
  *r.mutable_value() = TensorOf({1, 4, 24}, 3);
  *r.mutable_key_padding_mask() = TensorOf({1, 4}, 4);
  *r.mutable_attn_mask() = TensorOf({len, 4}, 5);
  r.set_need_weights(true);
  return r;
}

// Reads `bytes`, cut into pieces of `sizes`, into `header` and `read`, once
// the reader is seen to agree with protobuf on those pieces.
void ReadAgreeing(const std::string& bytes, const std::vector<int>& sizes,
                  absl::Span<const PayloadField> fields, const char* what,
                  google::protobuf::MessageLite& header, ReadResult& read) {
  const WirePieces pieces = SplitInto(bytes, sizes);
  EXPECT_EQ(CheckReadAgrees(bytes, pieces), "");
  ASSERT_TRUE(ReadWireMessage(pieces, fields, what, header, read).ok());
}

TEST(WireReaderTest, TensorBytesStayInTheReceivedPiecesAndTheRestParses) {
  const std::string bytes = FullRequest(300).SerializeAsString();
  for (const std::vector<int>& sizes :
       std::vector<std::vector<int>>{{}, {1}, {7}, {4096}, {3, 1000, 1}, {16384}}) {
    v1::AttendRequest header;
    ReadResult read;
    ASSERT_NO_FATAL_FAILURE(
        ReadAgreeing(bytes, sizes, kAttendRequestPayloads, "AttendRequest", header, read));
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

TEST(WireReaderTest, StreamAndAppendMessagesKeepTheirTensorsInThePieces) {
  v1::StreamRequest stream;
  stream.set_id("s");
  *stream.mutable_attend() = FullRequest(200);
  v1::StreamRequest step;
  step.set_id("t");
  step.mutable_append()->set_session_id("x");
  *step.mutable_append()->mutable_query() = TensorOf({1, 100, 24}, 9);
  for (const v1::StreamRequest& message : {stream, step}) {
    const std::string bytes = message.SerializeAsString();
    v1::StreamRequest header;
    ReadResult read;
    ASSERT_NO_FATAL_FAILURE(
        ReadAgreeing(bytes, {333}, kStreamRequestPayloads, "StreamRequest", header, read));
    EXPECT_FALSE(read.whole);
    const int attend_query[] = {2, 2, 3};
    const int append_query[] = {4, 2, 3};
    const WirePayload* query =
        LastPayload(read, message.has_attend() ? attend_query : append_query);
    ASSERT_NE(query, nullptr);
    EXPECT_EQ(query->size, message.has_attend() ? 200 * 24 * 4 : 100 * 24 * 4);
    EXPECT_EQ(header.id(), message.id());
  }
  v1::StreamResponse answer;
  answer.set_id("s");
  *answer.mutable_attend()->mutable_output() = TensorOf({1, 200, 24}, 3);
  answer.mutable_attend()->set_model("demo");
  EXPECT_EQ(CheckWriteRoundTrips(answer.SerializeAsString()), "");
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
  inference::ModelInferRequest header;
  ReadResult read;
  ASSERT_NO_FATAL_FAILURE(
      ReadAgreeing(bytes, {999}, kInferRequestPayloads, "ModelInferRequest", header, read));
  EXPECT_EQ(header.raw_input_contents_size(), 3);
  ASSERT_EQ(read.payloads.size(), 3u);
  EXPECT_EQ(read.payloads[2].size, 70000);
}

TEST(WireWriterTest, ResponsesWrittenAroundTheirPayloadsParseToTheSameMessage) {
  v1::AttendResponse attend;
  attend.set_model("demo");
  attend.set_model_version(2);
  *attend.mutable_output() = TensorOf({1, 300, 24}, 6);
  *attend.mutable_attn_weights() = TensorOf({1, 300, 300}, 7);
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

// A view's bytes go to gRPC where they are, and its owner lives as long as
// gRPC holds them: no copy of an engine call's output on the way out.
TEST(WireWriterTest, ViewsAreSentFromWhereTheyAreWhileGrpcHoldsTheirOwner) {
  auto owner = std::make_shared<std::vector<float>>(70000, 1.5f);
  const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(owner->data()),
                                        owner->size() * sizeof(float));
  v1::Tensor fields;
  fields.set_dtype(v1::DATA_TYPE_FP32);
  fields.add_shape(70000);
  WireWriter writer;
  writer.AppendMessageWithBytes(1, fields, 3, bytes, owner);
  v1::AttendResponse rest;
  rest.set_model("m");
  writer.Append(rest);
  grpc::ByteBuffer buffer = writer.Finish();
  EXPECT_EQ(owner.use_count(), 2);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  int viewed = 0;
  std::string flat;
  for (const grpc::Slice& slice : slices) {
    viewed += slice.begin() == bytes.data() && slice.size() == bytes.size();
    flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  EXPECT_EQ(viewed, 1);
  v1::AttendResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(flat));
  EXPECT_EQ(parsed.model(), "m");
  EXPECT_EQ(parsed.output().data(),
            std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  slices.clear();
  buffer.Clear();
  EXPECT_EQ(owner.use_count(), 1);  // gRPC let go of it

  // Below kViewMinBytes a view is copied at once: nothing holds the owner.
  WireWriter small;
  small.AppendBytes(6, bytes.subspan(0, 1000), owner);
  EXPECT_EQ(owner.use_count(), 1);
  std::vector<grpc::Slice> copied;
  ASSERT_TRUE(small.Finish().Dump(&copied).ok());
  for (const grpc::Slice& slice : copied) EXPECT_NE(slice.begin(), bytes.data());
}

// A large payload written in place (an fp16 output) goes out in a buffer
// from TakeLarge, kept once gRPC is done with it: the next call's payload of
// that size takes the same memory instead of faulting in a fresh buffer.
TEST(WireWriterTest, LargePayloadBuffersAreKeptForTheNextCall) {
  ReleaseKeptLarge();
  const size_t size = size_t{4} << 20;
  const uint8_t* sent = nullptr;
  {
    WireWriter writer;
    writer.AppendBytes(6, size, [](uint8_t* out) { std::memset(out, 7, size); });
    grpc::ByteBuffer buffer = writer.Finish();
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(buffer.Dump(&slices).ok());
    for (const grpc::Slice& slice : slices) {
      if (slice.size() == size) sent = slice.begin();
    }
    ASSERT_NE(sent, nullptr);
    EXPECT_EQ(KeptLargeBytes(), 0u);  // gRPC holds it
  }
  EXPECT_GE(KeptLargeBytes(), size);  // given back, kept
  size_t capacity = 0;
  void* next = TakeLarge(size, &capacity);
  EXPECT_EQ(next, sent);
  ReturnLarge(next, capacity);
  ReleaseKeptLarge();
  EXPECT_EQ(KeptLargeBytes(), 0u);
}

}  // namespace
}  // namespace mha::wire
