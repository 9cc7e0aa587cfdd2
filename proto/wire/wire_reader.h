// Reads a protobuf message as it arrived (in several buffers) without
// copying its tensor bytes: the fields named as payloads stay where gRPC
// received them, and everything else is parsed by protobuf as usual.
#ifndef MHA_PROTO_WIRE_WIRE_READER_H_
#define MHA_PROTO_WIRE_WIRE_READER_H_

#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace mha::wire {

using WirePieces = std::vector<absl::Span<const uint8_t>>;

// A field that holds tensor bytes: a `bytes` field (no `inner`), or a
// message field whose own fields named in `inner` hold them.
struct PayloadField {
  int number = 0;
  std::vector<PayloadField> inner;
};

// One payload as received: the path of field numbers that leads to it
// (e.g. {2, 3}: AttendRequest.query.data) and its bytes, in pieces of the
// received buffers.
struct WirePayload {
  std::vector<int> path;
  WirePieces pieces;
  int64_t size = 0;
};

// A message read from `pieces` (which must outlive it): `header` holds every
// field but the payloads (each left as an empty field in its place, so a
// repeated field keeps its count), `payloads` the payloads in the order they
// came. Anything unusual in the encoding (groups, a non-minimal tag or
// length, a truncated field) is left to protobuf: then the whole message is
// parsed into `header` and `payloads` is empty. Either way the result is
// what protobuf's own parser makes of the bytes: the same fields, and the
// same refusals (INVALID_ARGUMENT naming `what`).
struct ReadResult {
  std::vector<WirePayload> payloads;
  bool whole = false;  // parsed whole by protobuf: the payloads are in `header`
};
absl::Status ReadWireMessage(const WirePieces& pieces, absl::Span<const PayloadField> fields,
                             const char* what, google::protobuf::MessageLite& header,
                             ReadResult& result);

// The server's messages read this way: AttendRequest's tensors (query,
// key, value and the masks, fields 2 to 6: their `data`, field 3), and
// ModelInferRequest's raw_input_contents (field 7).
inline const PayloadField kAttendRequestPayloads[] = {
    {2, {{3, {}}}}, {3, {{3, {}}}}, {4, {{3, {}}}}, {5, {{3, {}}}}, {6, {{3, {}}}}};
inline const PayloadField kInferRequestPayloads[] = {{7, {}}};
// AppendRequest's query (field 2: its `data`, field 3).
inline const PayloadField kAppendRequestPayloads[] = {{2, {{3, {}}}}};
// StreamRequest's attend (field 2) and append (field 4) messages.
inline const PayloadField kStreamRequestPayloads[] = {
    {2, std::vector<PayloadField>(std::begin(kAttendRequestPayloads),
                                  std::end(kAttendRequestPayloads))},
    {4, std::vector<PayloadField>(std::begin(kAppendRequestPayloads),
                                  std::end(kAppendRequestPayloads))}};
// And, for the clients, AttendResponse's output and attn_weights (fields 1
// and 2: their `data`, field 3).
inline const PayloadField kAttendResponsePayloads[] = {{1, {{3, {}}}}, {2, {{3, {}}}}};

// A message as gRPC received it, read around its payloads: the slices it
// arrived in (which the payloads' pieces point into), its other fields and
// where its payloads are. Not copyable (the views point into it); movable
// only before Read.
template <typename Message>
struct ReceivedMessage {
  std::vector<grpc::Slice> slices;
  WirePieces pieces;
  Message fields;
  ReadResult read;

  ReceivedMessage() = default;
  ReceivedMessage(const ReceivedMessage&) = delete;
  ReceivedMessage& operator=(const ReceivedMessage&) = delete;

  absl::Status Read(const grpc::ByteBuffer& buffer, absl::Span<const PayloadField> payloads,
                    const char* what);
  // The pieces of the last payload at `path`, or null.
  const WirePieces* Payload(absl::Span<const int> path) const;
};

// The last payload whose path is `path` (the value protobuf keeps when a
// field comes twice), or null.
const WirePayload* LastPayload(const ReadResult& result, absl::Span<const int> path);

// Appends the bytes of `pieces`, in order, to `out` (for what needs them in
// one string: a message parsed whole, a step's few tokens, a file).
void AppendPieces(const WirePieces& pieces, std::string& out);

// The slices of `buffer` (references, not copies) and their bytes as pieces.
absl::Status SlicesOf(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>& slices,
                      WirePieces& pieces);

template <typename Message>
absl::Status ReceivedMessage<Message>::Read(const grpc::ByteBuffer& buffer,
                                            absl::Span<const PayloadField> payloads,
                                            const char* what) {
  if (absl::Status s = SlicesOf(buffer, slices, pieces); !s.ok()) return s;
  return ReadWireMessage(pieces, payloads, what, fields, read);
}

template <typename Message>
const WirePieces* ReceivedMessage<Message>::Payload(absl::Span<const int> path) const {
  const WirePayload* p = LastPayload(read, path);
  return p == nullptr ? nullptr : &p->pieces;
}

}  // namespace mha::wire

#endif  // MHA_PROTO_WIRE_WIRE_READER_H_
