// Attend over gRPC's generic stub, its tensors written and read around
// their bytes (proto/wire/): a request's tensors are copied once, into the
// slices gRPC sends; a response's stay in the slices gRPC received.
#ifndef MHA_CLIENT_ATTEND_WIRE_H_
#define MHA_CLIENT_ATTEND_WIRE_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "wire/wire_reader.h"

namespace mha::client {

inline constexpr char kAttendMethod[] = "/mha.v1.AttentionService/Attend";

// `request` as the bytes gRPC sends (the same wire format as protobuf's).
grpc::ByteBuffer AttendRequestBytes(const v1::AttendRequest& request);

// A response as received: its output's and weights' data are views of the
// received slices (`output()`, `weights()`: null when absent).
class ReceivedAttendResponse : public wire::ReceivedMessage<v1::AttendResponse> {
 public:
  absl::Status Read(const grpc::ByteBuffer& bytes);
  const wire::WirePieces* output() const { return Payload(kOutput); }
  const wire::WirePieces* weights() const { return Payload(kWeights); }
  // The whole message, its tensors' data copied in (for files and printing).
  v1::AttendResponse Whole() const;

 private:
  static constexpr int kOutput[] = {1, 3};
  static constexpr int kWeights[] = {2, 3};
};

// One Attend call over `stub` with `request`; `done` gets the status and the
// response (read as above). The context and the request must live until then.
void CallAttend(grpc::GenericStub& stub, grpc::ClientContext* context,
                const grpc::ByteBuffer& request,
                std::function<void(absl::Status, std::unique_ptr<ReceivedAttendResponse>)> done);

// The same call on the calling thread, which polls `cq` (its own, and
// nothing else in flight on it) until the answer is in: gRPC reads and
// writes on this thread, with no hand-over to its callback threads. One
// call at a time, as a blocking client makes them: 2 MiB each way 1.2-1.6
// ms against 2.2-3.8 through callbacks, 16 MiB 10.4 against 12.4-15.1 ms
// (tests/bench/grpc_echo.cc --cq, AMD EPYC VM).
absl::Status CallAttendPolling(grpc::GenericStub& stub, grpc::ClientContext* context,
                               const grpc::ByteBuffer& request, grpc::CompletionQueue& cq,
                               ReceivedAttendResponse& response);

}  // namespace mha::client

#endif  // MHA_CLIENT_ATTEND_WIRE_H_
