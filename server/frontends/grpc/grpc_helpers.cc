#include "server/frontends/grpc/grpc_helpers.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "server/observability/logger.h"

namespace mha::server {

absl::string_view AuthorizationOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
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

int MethodIndex(const google::protobuf::FileDescriptor& file, const std::string& service,
                const std::string& method) {
  const google::protobuf::ServiceDescriptor* s = file.FindServiceByName(service);
  const google::protobuf::MethodDescriptor* m =
      s == nullptr ? nullptr : s->FindMethodByName(method);
  if (m == nullptr) {
    LogError(absl::StrCat("no method ", service, ".", method, " in ", file.name()));
    std::abort();
  }
  return m->index();
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
