#include "client/attend_wire.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "wire/wire_writer.h"

namespace mha::client {
namespace {

// AttendRequest's tensor fields by number (query ... attn_mask: 2 to 6).
const v1::Tensor* TensorField(const v1::AttendRequest& r, int number) {
  switch (number) {
    case 2:
      return r.has_query() ? &r.query() : nullptr;
    case 3:
      return r.has_key() ? &r.key() : nullptr;
    case 4:
      return r.has_value() ? &r.value() : nullptr;
    case 5:
      return r.has_key_padding_mask() ? &r.key_padding_mask() : nullptr;
    default:
      return r.has_attn_mask() ? &r.attn_mask() : nullptr;
  }
}

// A call's answer: gRPC's status, or the response read from its bytes.
absl::Status Read(const grpc::Status& status, const grpc::ByteBuffer& bytes,
                  ReceivedAttendResponse& response) {
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return response.Read(bytes);
}

}  // namespace

grpc::ByteBuffer AttendRequestBytes(const v1::AttendRequest& request) {
  wire::WireWriter writer;
  for (int number = 2; number <= 6; ++number) {
    const v1::Tensor* tensor = TensorField(request, number);
    if (tensor == nullptr) continue;
    v1::Tensor fields = *tensor;
    fields.clear_data();
    const std::string& data = tensor->data();
    writer.AppendMessageWithBytes(number, fields, 3, data.size(), [&](uint8_t* out) {
      std::memcpy(out, data.data(), data.size());
    });
  }
  v1::AttendRequest rest = request;
  rest.clear_query();
  rest.clear_key();
  rest.clear_value();
  rest.clear_key_padding_mask();
  rest.clear_attn_mask();
  writer.Append(rest);
  return writer.Finish();
}

absl::Status ReceivedAttendResponse::Read(const grpc::ByteBuffer& bytes) {
  return ReceivedMessage::Read(bytes, wire::kAttendResponsePayloads, "AttendResponse");
}

v1::AttendResponse ReceivedAttendResponse::Whole() const {
  v1::AttendResponse whole = fields;
  if (const wire::WirePieces* p = output(); p != nullptr) {
    wire::AppendPieces(*p, *whole.mutable_output()->mutable_data());
  }
  if (const wire::WirePieces* p = weights(); p != nullptr) {
    wire::AppendPieces(*p, *whole.mutable_attn_weights()->mutable_data());
  }
  return whole;
}

absl::Status CallAttendPolling(grpc::GenericStub& stub, grpc::ClientContext* context,
                               const grpc::ByteBuffer& request, grpc::CompletionQueue& cq,
                               ReceivedAttendResponse& response) {
  grpc::ByteBuffer bytes;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(context, kAttendMethod, request, &cq);
  call->StartCall();
  call->Finish(&bytes, &status, call.get());
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || tag != call.get()) {
    return absl::InternalError("the completion queue ended before the call");
  }
  return Read(status, bytes, response);
}

void CallAttend(grpc::GenericStub& stub, grpc::ClientContext* context,
                const grpc::ByteBuffer& request,
                std::function<void(absl::Status, std::unique_ptr<ReceivedAttendResponse>)> done) {
  auto bytes = std::make_shared<grpc::ByteBuffer>();
  stub.UnaryCall(context, kAttendMethod, grpc::StubOptions(), &request, bytes.get(),
                 [bytes, done = std::move(done)](grpc::Status status) {
                   auto response = std::make_unique<ReceivedAttendResponse>();
                   absl::Status result = Read(status, *bytes, *response);
                   done(std::move(result), std::move(response));
                 });
}

}  // namespace mha::client
