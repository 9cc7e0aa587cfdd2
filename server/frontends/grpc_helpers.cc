#include "server/frontends/grpc_helpers.h"

#include <utility>

namespace mha::server {

std::string MessageOf(const absl::Status& status) {
  if (!status.message().empty()) return std::string(status.message());
  return absl::StatusCodeToString(status.code());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), MessageOf(status));
}

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::function<void(const absl::Status&)> FinisherOf(grpc::ServerUnaryReactor* reactor) {
  return [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
}

void SendUnary(grpc::CallbackServerContext* context, CallReactor* reactor,
               const absl::Status& status, absl::Duration took, absl::Duration compute) {
  context->AddTrailingMetadata(std::string(kServerTimeMetadata),
                               std::to_string(absl::ToInt64Microseconds(took)));
  if (compute > absl::ZeroDuration()) {
    context->AddTrailingMetadata(std::string(kComputeTimeMetadata),
                                 std::to_string(absl::ToInt64Microseconds(compute)));
  }
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace mha::server
