#include "tests/proto/wire/wire_check.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
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

// Puts `data` back into `message` at `path` (field numbers): singular
// message fields descended, the last a bytes field (a repeated one: its
// next element in order, counted in `next`).
bool PutBack(google::protobuf::Message& message, absl::Span<const int> path, std::string data,
             std::map<const google::protobuf::FieldDescriptor*, int>& next) {
  const google::protobuf::FieldDescriptor* field =
      message.GetDescriptor()->FindFieldByNumber(path[0]);
  const google::protobuf::Reflection* r = message.GetReflection();
  if (field == nullptr) return false;
  if (path.size() > 1) {
    if (field->is_repeated() || field->type() != google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      return false;
    }
    return PutBack(*r->MutableMessage(&message, field), path.subspan(1), std::move(data), next);
  }
  if (field->type() != google::protobuf::FieldDescriptor::TYPE_BYTES) return false;
  if (!field->is_repeated()) {
    r->SetString(&message, field, std::move(data));
    return true;
  }
  const int index = next[field]++;
  if (index >= r->FieldSize(message, field)) return false;
  if (!r->GetRepeatedString(message, field, index).empty()) return false;  // not emptied
  r->SetRepeatedString(&message, field, index, std::move(data));
  return true;
}

// The message read by the wire reader with its payloads put back, against
// protobuf's own parse.
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
  std::map<const google::protobuf::FieldDescriptor*, int> next;
  for (const WirePayload& p : read.payloads) {
    std::string data;
    AppendPieces(p.pieces, data);
    if (static_cast<int64_t>(data.size()) != p.size) return std::string(name) + ": payload size";
    if (!PutBack(got, p.path, std::move(data), next)) {
      return std::string(name) + ": a payload's path is not a bytes field left empty";
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

// `data` as bytes a view may send: a copy its owner keeps alive.
struct Viewed {
  absl::Span<const uint8_t> bytes;
  std::shared_ptr<const void> owner;
};
Viewed ViewOf(const std::string& data) {
  auto copy = std::make_shared<const std::string>(data);
  return {{reinterpret_cast<const uint8_t*>(copy->data()), copy->size()}, copy};
}

// Written filled by the writer, or (`view`) sent from a buffer of its own.
void AppendTensor(int number, const v1::Tensor& tensor, WireWriter& writer, bool view = false) {
  v1::Tensor fields = tensor;
  fields.clear_data();
  const std::string& data = tensor.data();
  if (view) {
    Viewed viewed = ViewOf(data);
    writer.AppendMessageWithBytes(number, fields, 3, viewed.bytes, std::move(viewed.owner));
    return;
  }
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
  for (const std::string& error :
       {Compare<v1::AttendRequest>(bytes, pieces, kAttendRequestPayloads, "AttendRequest"),
        Compare<v1::AppendRequest>(bytes, pieces, kAppendRequestPayloads, "AppendRequest"),
        Compare<v1::StreamRequest>(bytes, pieces, kStreamRequestPayloads, "StreamRequest"),
        Compare<inference::ModelInferRequest>(bytes, pieces, kInferRequestPayloads,
                                              "ModelInferRequest")}) {
    if (!error.empty()) return error;
  }
  return "";
}

std::string CheckWriteRoundTrips(absl::string_view bytes) {
  v1::AttendResponse attend;
  if (attend.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    WireWriter writer;
    if (attend.has_output()) AppendTensor(1, attend.output(), writer);
    if (attend.has_attn_weights()) AppendTensor(2, attend.attn_weights(), writer, /*view=*/true);
    v1::AttendResponse rest = attend;
    rest.clear_output();
    rest.clear_attn_weights();
    writer.Append(rest);
    const size_t size = writer.size();
    std::string error = RoundTrip(attend, writer.Finish(), size, "AttendResponse");
    if (!error.empty()) return error;
  }
  v1::StreamResponse stream;
  if (stream.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())) && stream.has_attend()) {
    WireWriter inner;  // the attend answer nested in the stream's
    if (stream.attend().has_output()) AppendTensor(1, stream.attend().output(), inner, true);
    if (stream.attend().has_attn_weights()) AppendTensor(2, stream.attend().attn_weights(), inner);
    v1::AttendResponse attend_rest = stream.attend();
    attend_rest.clear_output();
    attend_rest.clear_attn_weights();
    inner.Append(attend_rest);
    WireWriter writer;
    v1::StreamResponse rest = stream;
    rest.clear_attend();
    writer.Append(rest);
    writer.AppendMessage(4, inner);
    const size_t size = writer.size();
    std::string error = RoundTrip(stream, writer.Finish(), size, "StreamResponse");
    if (!error.empty()) return error;
  }
  inference::ModelInferResponse infer;
  if (infer.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    WireWriter writer;
    inference::ModelInferResponse rest = infer;
    rest.clear_raw_output_contents();
    writer.Append(rest);
    bool view = false;  // every other one sent from a buffer of its own
    for (const std::string& raw : infer.raw_output_contents()) {
      if (view) {
        Viewed viewed = ViewOf(raw);
        writer.AppendBytes(6, viewed.bytes, std::move(viewed.owner));
      } else {
        writer.AppendBytes(6, raw.size(),
                           [&](uint8_t* out) { std::copy(raw.begin(), raw.end(), out); });
      }
      view = !view;
    }
    const size_t size = writer.size();
    return RoundTrip(infer, writer.Finish(), size, "ModelInferResponse");
  }
  return "";
}

}  // namespace mha::wire::testing
