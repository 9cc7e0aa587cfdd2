// Writes a protobuf message as gRPC sends it, without copying tensor bytes
// twice: the fields of small size are serialized by protobuf, and each
// payload is a buffer of its own that is filled once and handed to gRPC as
// a slice that owns it, or bytes that are already where they are (a view
// whose owner the slice holds until gRPC has sent them).
#ifndef MHA_PROTO_WIRE_WIRE_WRITER_H_
#define MHA_PROTO_WIRE_WIRE_WRITER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace mha::wire {

// The bytes of one message, in order. Not thread-safe.
class WireWriter {
 public:
  using Fill = absl::FunctionRef<void(uint8_t* out)>;

  // `fields` serialized (a message's fields may come in any order and
  // several parts: protobuf merges them).
  void Append(const google::protobuf::MessageLite& fields);
  // Field `number` (bytes) of `size` bytes, which `fill` writes.
  void AppendBytes(int number, size_t size, Fill fill);
  // Field `number`, a message: `fields` serialized, then its bytes field
  // `data_number` of `size` bytes, which `fill` writes.
  void AppendMessageWithBytes(int number, const google::protobuf::MessageLite& fields,
                              int data_number, size_t size, Fill fill);

  // The same with the payload's bytes sent from where they are: gRPC holds
  // a copy of `owner`, which keeps `bytes` alive, until it has sent them.
  // Below kViewMinBytes the bytes are copied instead (and `owner` let go):
  // a copy that small costs less than holding the owner across threads.
  void AppendBytes(int number, absl::Span<const uint8_t> bytes, std::shared_ptr<const void> owner);
  void AppendMessageWithBytes(int number, const google::protobuf::MessageLite& fields,
                              int data_number, absl::Span<const uint8_t> bytes,
                              std::shared_ptr<const void> owner);

  // Field `number`, a message: what `inner` wrote (its payloads are moved,
  // not copied). `inner` is empty after.
  void AppendMessage(int number, WireWriter& inner);

  size_t size() const { return size_; }
  // The message as gRPC's buffer; the writer is empty after.
  grpc::ByteBuffer Finish();

 private:
  void AppendTag(int number);  // length-delimited
  void AppendPayload(size_t size, Fill fill);
  void AppendPayload(absl::Span<const uint8_t> bytes, std::shared_ptr<const void> owner);
  // The length-delimited header of a message field that holds `fields`
  // and then a bytes field `data_number` of `size` bytes.
  void AppendMessageHeader(int number, const google::protobuf::MessageLite& fields, int data_number,
                           size_t size);
  void Flush();

  std::string pending_;  // serialized bytes not yet in a slice
  std::vector<grpc::Slice> slices_;
  size_t size_ = 0;
};

// The least payload a view sends from where it is; a smaller one is copied
// into a slice of gRPC's own, as any payload that small is written.
inline constexpr size_t kViewMinBytes = size_t{256} << 10;

// `value` as a protobuf varint, appended to `out`.
void AppendVarint(uint64_t value, std::string& out);
// Field `number`'s length-delimited tag and `size` as protobuf encodes them.
size_t BytesFieldOverhead(int number, size_t size);

}  // namespace mha::wire

#endif  // MHA_PROTO_WIRE_WIRE_WRITER_H_
