#include "server/kserve_service.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/kserve_codec.h"

#ifndef MHA_VERSION
#define MHA_VERSION "0"
#endif

namespace mha::server {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

absl::StatusOr<VersionPtr> KserveServiceImpl::FindVersion(const std::string& name,
                                                           const std::string& version) const {
  absl::StatusOr<int64_t> number = ParseModelVersion(name, version);
  if (!number.ok()) return number.status();
  return dispatcher_.models().Find(name, *number);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest*,
    inference::ServerReadyResponse* response) {
  response->set_ready(!dispatcher_.draining());  // as grpc.health.v1's overall status
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  absl::StatusOr<VersionPtr> model = FindVersion(request->name(), request->version());
  if (absl::IsFailedPrecondition(model.status())) {  // failed to load: not ready
    response->set_ready(false);
    return Finish(context, absl::OkStatus());
  }
  if (model.ok()) response->set_ready(!dispatcher_.draining());
  return Finish(context, model.status());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  const absl::Status allowed = dispatcher_.Authorize(*context);
  if (allowed.ok()) {
    response->set_name("mha-serve");
    response->set_version(MHA_VERSION);
    // Of the protocol's optional extensions: request parameters (is_causal,
    // need_weights, per_head_weights). Repository and statistics are not.
    response->add_extensions("parameters");
  }
  return Finish(context, allowed);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::Status status = dispatcher_.Authorize(*context);
  if (status.ok()) {
    absl::StatusOr<VersionPtr> model = FindVersion(request->name(), request->version());
    status = model.status();
    if (status.ok()) {
      DescribeModel((*model)->name, (*model)->model.dims,
                    dispatcher_.models().ReadyVersions(request->name()), response);
    }
  }
  return Finish(context, status);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const inference::ModelInferRequest* request,
                                                        inference::ModelInferResponse* response) {
  auto* reactor = new CallReactor();
  auto outputs = std::make_shared<std::vector<std::string>>();
  // An unparsable version is refused by decode, so that it is counted and
  // answered like every other refusal.
  const absl::StatusOr<int64_t> version =
      ParseModelVersion(request->model_name(), request->model_version());
  auto decode = [this, request, outputs, version_error = version.status()](
                    const ModelVersion& model) -> absl::StatusOr<AttentionRequest> {
    if (!version_error.ok()) return version_error;
    return DecodeInferRequest(*request, model.model.dims, dispatcher_.limits(), *outputs);
  };
  auto respond = [request, response, outputs](const ModelVersion& model,
                                              const ResultLayout& layout,
                                              const AttentionResult& result) {
    FillInferResponse(*request, model.version, *outputs, layout, result, response);
  };
  dispatcher_.Dispatch(context, reactor, request->model_name(), version.value_or(0), kApiKserve,
                       decode, std::move(respond));
  return reactor;
}

}  // namespace mha::server
