#include "server/frontends/grpc/unknown_methods.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace mha::server {
namespace {

class Refusal final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Refusal(const std::string& method) {
    Finish(grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrCat("method ", method.empty() ? "(none)" : method,
                     " is not served by mha-serve (served: mha.v1.AttentionService, "
                     "inference.GRPCInferenceService as docs/KSERVE.md lists, grpc.health.v1, "
                     "grpc.reflection)")));
  }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerGenericBidiReactor* UnknownMethods::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new Refusal(context->method());
}

}  // namespace mha::server
