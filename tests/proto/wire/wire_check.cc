#include "tests/proto/wire/wire_check.h"

#include <algorithm>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/message_differencer.h"
#include "inference/grpc_service.pb.h"
#include "mha/v1/attention.pb.h"
#include "wire/wire_writer.h"

namespace mha::wire::testing {
namespace {

// The bytes of `m` in protobuf's deterministic order (maps sorted): equal
// for equal messages, NaN payloads included.
std::string Canonical(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

// "" when `a` and `b` hold the same fields, else protobuf's account.
std::string Differences(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  std::string left = Canonical(a), right = Canonical(b);
  if (left == right) return "";
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  differ.Compare(a, b);
  return diff.empty() ? "their bytes differ" : diff;
}

std::string Joined(const WirePieces& pieces) {
  std::string s;
  for (absl::Span<const uint8_t> p : pieces)
    s.append(reinterpret_cast<const char*>(p.data()), p.size());
  return s;
}

v1::Tensor* TensorField(v1::AttendRequest& r, int number) {
  switch (number) {
    case 2:
      return r.mutable_query();
    case 3:
      return r.mutable_key();
    case 4:
      return r.mutable_value();
    case 5:
      return r.mutable_key_padding_mask();
    default:
      return r.mutable_attn_mask();
  }
}

// The message read by the wire reader with its payloads put back.
template <typename Message>
std::string Compare(absl::string_view bytes, const WirePieces& pieces,
                    absl::Span<const PayloadField> fields, const char* name) {
  Message expected;
  const bool parses = expected.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  Message got;
  ReadResult read;
  const absl::Status status = ReadWireMessage(pieces, fields, name, got, read);
  if (status.ok() != parses) {
    return std::string(name) +
           (parses ? ": protobuf accepts, the reader refuses: " + std::string(status.message())
                   : ": protobuf refuses, the reader accepts");
  }
  if (!parses) {
    if (status.code() != absl::StatusCode::kInvalidArgument)
      return "refused without INVALID_ARGUMENT";
    return "";
  }
  if (read.whole && !read.payloads.empty()) return std::string(name) + ": whole with payloads";
  int raw_index = 0;
  for (const WirePayload& p : read.payloads) {
    std::string data = Joined(p.pieces);
    if (static_cast<int64_t>(data.size()) != p.size) return std::string(name) + ": payload size";
    if constexpr (std::is_same_v<Message, v1::AttendRequest>) {
      if (p.path.size() != 2 || p.path[1] != 3) return "attend payload path";
      TensorField(got, p.path[0])->set_data(std::move(data));
    } else {
      if (p.path.size() != 1 || p.path[0] != 7) return "infer payload path";
      if (raw_index >= got.raw_input_contents_size()) return "more payloads than raw contents";
      if (!got.raw_input_contents(raw_index).empty()) return "a payload's place is not empty";
      got.set_raw_input_contents(raw_index++, std::move(data));
    }
  }
  const std::string diff = Differences(expected, got);
  return diff.empty() ? "" : std::string(name) + ": fields differ: " + diff;
}

std::string Flatten(grpc::ByteBuffer buffer) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string s;
  for (const grpc::Slice& slice : slices)
    s.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return s;
}

void AppendTensor(int number, const v1::Tensor& tensor, WireWriter& writer) {
  v1::Tensor fields = tensor;
  fields.clear_data();
  const std::string& data = tensor.data();
  writer.AppendMessageWithBytes(number, fields, 3, data.size(),
                                [&](uint8_t* out) { std::copy(data.begin(), data.end(), out); });
}

template <typename Message>
std::string RoundTrip(const Message& written, grpc::ByteBuffer buffer, size_t size,
                      const char* name) {
  const std::string bytes = Flatten(std::move(buffer));
  if (bytes.size() != size) return std::string(name) + ": the writer's size is not its bytes'";
  Message read;
  if (!read.ParseFromString(bytes))
    return std::string(name) + ": what the writer wrote does not parse";
  const std::string diff = Differences(written, read);
  return diff.empty() ? "" : std::string(name) + ": read back differs: " + diff;
}

}  // namespace

WirePieces SplitInto(absl::string_view bytes, absl::Span<const int> sizes) {
  WirePieces pieces;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t at = 0;
  for (size_t i = 0; at < bytes.size(); ++i) {
    const size_t n = sizes.empty() ? bytes.size() : std::max(1, sizes[i % sizes.size()]);
    const size_t k = std::min(n, bytes.size() - at);
    pieces.emplace_back(p + at, k);
    at += k;
  }
  return pieces;
}

std::string CheckReadAgrees(absl::string_view bytes, const WirePieces& pieces) {
  std::string error =
      Compare<v1::AttendRequest>(bytes, pieces, kAttendRequestPayloads, "AttendRequest");
  if (!error.empty()) return error;
  return Compare<inference::ModelInferRequest>(bytes, pieces, kInferRequestPayloads,
                                               "ModelInferRequest");
}

std::string CheckWriteRoundTrips(absl::string_view bytes) {
  v1::AttendResponse attend;
  if (attend.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    WireWriter writer;
    if (attend.has_output()) AppendTensor(1, attend.output(), writer);
    if (attend.has_attn_weights()) AppendTensor(2, attend.attn_weights(), writer);
    v1::AttendResponse rest = attend;
    rest.clear_output();
    rest.clear_attn_weights();
    writer.Append(rest);
    const size_t size = writer.size();
    std::string error = RoundTrip(attend, writer.Finish(), size, "AttendResponse");
    if (!error.empty()) return error;
  }
  inference::ModelInferResponse infer;
  if (infer.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    WireWriter writer;
    inference::ModelInferResponse rest = infer;
    rest.clear_raw_output_contents();
    writer.Append(rest);
    for (const std::string& raw : infer.raw_output_contents()) {
      writer.AppendBytes(6, raw.size(),
                         [&](uint8_t* out) { std::copy(raw.begin(), raw.end(), out); });
    }
    const size_t size = writer.size();
    return RoundTrip(infer, writer.Finish(), size, "ModelInferResponse");
  }
  return "";
}

}  // namespace mha::wire::testing
