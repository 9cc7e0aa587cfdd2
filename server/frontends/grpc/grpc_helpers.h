// The gRPC helpers both gRPC front ends share: the one status mapping, a
// call's transport answers (OverGrpc), the server-time trailer, and
// finishing unary calls (at once, from a callback, or through an attention
// call's reactor, UnaryCall). Stream reactors are message_stream.h's.
#ifndef MHA_SERVER_FRONTENDS_GRPC_HELPERS_H_
#define MHA_SERVER_FRONTENDS_GRPC_HELPERS_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"
#include "server/frontends/common/answer_metadata.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

// The one conversion from absl::Status to grpc::Status (its message:
// MessageOf).
grpc::Status ToGrpcStatus(const absl::Status& status);

// The index of `method` of `service` in `file` (the order of the methods a
// generated service registers). Aborts when there is none: a programming
// error.
int MethodIndex(const google::protobuf::FileDescriptor& file, const std::string& service,
                const std::string& method);

// The value of a gRPC call's "authorization" metadata ("" when absent).
absl::string_view AuthorizationOf(const grpc::CallbackServerContext& context);

// A dispatched call (front_end_gate.h) of a gRPC call: its transport's
// answers (the authorization metadata, cancellation, the deadline) from the
// call's context (a stream's for its messages), which outlives it. The
// remaining arguments construct `Call`.
template <typename Call>
class OverGrpc : public Call {
 public:
  template <typename... CallArgs>
  explicit OverGrpc(grpc::CallbackServerContext* context, CallArgs&&... call_args)
      : Call(std::forward<CallArgs>(call_args)...), context_(context) {}

  absl::string_view Authorization() const override { return AuthorizationOf(*context_); }
  bool Cancelled() const override { return context_->IsCancelled(); }
  absl::Time TransportDeadline() const override { return absl::FromChrono(context_->deadline()); }

 protected:
  grpc::CallbackServerContext* const context_;
};

// Finishes a unary call now with `status` (its default reactor).
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status);
// What finishes `reactor` with a status given later (a callback's answer).
std::function<void(const absl::Status&)> FinisherOf(grpc::ServerUnaryReactor* reactor);

// The reactor of one unary attention call. Its call finishes it exactly
// once; it holds the request's memory reservation until gRPC is done with
// the call (response sent, or call cancelled), then deletes itself.
class CallReactor : public grpc::ServerUnaryReactor {
 public:
  void Hold(std::shared_ptr<MemoryReservation> memory) { memory_ = std::move(memory); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<MemoryReservation> memory_;
};

// Answers a unary attention call: the server-time trailer (and the
// compute-time one when `compute` is not zero), then the status.
void SendUnary(grpc::CallbackServerContext* context, CallReactor* reactor,
               const absl::Status& status, absl::Duration took,
               absl::Duration compute = absl::ZeroDuration());

// A dispatched call (front_end_gate.h) answered over a unary RPC: `Call`'s
// Send and Hold go to the call's CallReactor. The remaining arguments
// construct `Call`.
template <typename Call>
class UnaryCall final : public OverGrpc<Call> {
 public:
  template <typename... CallArgs>
  UnaryCall(grpc::CallbackServerContext* context, CallReactor* reactor, CallArgs&&... call_args)
      : OverGrpc<Call>(context, std::forward<CallArgs>(call_args)...), reactor_(reactor) {}

 private:
  void Send(const absl::Status& status, absl::Duration took) override {
    SendUnary(this->context_, reactor_, status, took, this->compute_time);
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    reactor_->Hold(std::move(memory));
  }

  CallReactor* const reactor_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_GRPC_HELPERS_H_
