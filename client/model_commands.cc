// mha_client's model commands: health, models, info, load_model and
// unload_model, each printing what the server said (exit code 0 or 1).
#include "client/model_commands.h"

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_common.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mha::client {

// grpc.health.v1 Check of the server ("") or of one model.
int Health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
           const ContextFactory& context) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(context().get(), request, &response);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND && !service.empty()) {
    // The health service only says "unknown": name what is served.
    v1::ListModelsResponse models;
    auto attention = v1::AttentionService::NewStub(channel);
    std::vector<std::string> names;
    if (attention->ListModels(context().get(), {}, &models).ok()) {
      for (const v1::ModelInfo& m : models.models()) names.push_back(m.name());
    }
    std::fprintf(stderr, "NOT_FOUND: no model '%s' on this server; it has: %s\n", service.c_str(),
                 absl::StrJoin(names, ", ").c_str());
    return 1;
  }
  if (!status.ok()) return ReportError(status);
  const bool serving = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  std::printf("%s: %s\n", service.empty() ? "server" : service.c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return serving ? 0 : 1;
}

int Models(v1::AttentionService::Stub& stub, const ContextFactory& context) {
  v1::ListModelsResponse response;
  const grpc::Status status = stub.ListModels(context().get(), {}, &response);
  if (!status.ok()) return ReportError(status);
  for (const v1::ModelInfo& m : response.models()) {
    std::vector<int64_t> ready;
    for (const v1::ModelVersionStatus& v : m.versions()) {
      if (v.state() == v1::ModelInfo::STATE_READY) ready.push_back(v.version());
    }
    std::printf(
        "%-24s %-6s %s\n", m.name().c_str(),
        m.state() == v1::ModelInfo::STATE_READY ? "READY" : "FAILED",
        m.state() == v1::ModelInfo::STATE_READY
            ? absl::StrCat("E=", m.embed_dim(), " h=", m.num_heads(), " layout=", m.weight_layout(),
                           " params=", m.parameter_count(), " versions=", absl::StrJoin(ready, ","))
                  .c_str()
            : m.error().c_str());
  }
  return 0;
}

int Info(v1::AttentionService::Stub& stub, const std::string& name, const ContextFactory& context) {
  v1::GetModelRequest request;
  request.set_name(name);
  v1::ModelInfo info;
  const grpc::Status status = stub.GetModel(context().get(), request, &info);
  if (!status.ok()) return ReportError(status);
  std::printf("%s", info.DebugString().c_str());
  return 0;
}

// `load_model NAME` / `unload_model NAME` (--model_control_mode poll or
// explicit on the server): waits for the load, then prints the versions.
int ControlModel(v1::AttentionService::Stub& stub, bool load, const std::string& name,
                 const ContextFactory& context) {
  std::unique_ptr<grpc::ClientContext> call = context();
  call->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  if (!load) {
    v1::UnloadModelRequest request;
    request.set_name(name);
    v1::UnloadModelResponse response;
    const grpc::Status status = stub.UnloadModel(call.get(), request, &response);
    if (!status.ok()) return ReportError(status);
    std::printf("%s: unloaded\n", name.c_str());
    return 0;
  }
  v1::LoadModelRequest request;
  request.set_name(name);
  v1::ModelInfo info;
  const grpc::Status status = stub.LoadModel(call.get(), request, &info);
  if (!status.ok()) return ReportError(status);
  for (const v1::ModelVersionStatus& v : info.versions()) {
    std::printf("%s version %lld: %s%s%s\n", name.c_str(), static_cast<long long>(v.version()),
                v.state() == v1::ModelInfo::STATE_READY ? "READY" : "FAILED",
                v.error().empty() ? "" : " ", v.error().c_str());
  }
  return 0;
}

}  // namespace mha::client
