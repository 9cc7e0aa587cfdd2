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

absl::StatusOr<const ServedModel*> KserveServiceImpl::FindVersion(
    const std::string& name, const std::string& version) const {
  absl::StatusOr<const ServedModel*> model = dispatcher_.models().Find(name);
  if (model.ok() && !version.empty() && version != kModelVersion) {
    return absl::NotFoundError(
        absl::StrCat("model ", name, " has no version \"", version, "\" (only \"1\")"));
  }
  return model;
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
  absl::StatusOr<const ServedModel*> model = FindVersion(request->name(), request->version());
  if (model.ok()) response->set_ready((*model)->load_status.ok() && !dispatcher_.draining());
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
    absl::StatusOr<const ServedModel*> model = FindVersion(request->name(), request->version());
    status = model.ok() ? (*model)->load_status : model.status();
    if (status.ok()) DescribeModel((*model)->name, (*model)->model.dims, response);
  }
  return Finish(context, status);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const inference::ModelInferRequest* request,
                                                        inference::ModelInferResponse* response) {
  auto* reactor = new CallReactor();
  auto outputs = std::make_shared<std::vector<std::string>>();
  auto decode = [this, request, outputs](const ServedModel& model)
      -> absl::StatusOr<AttentionRequest> {
    absl::StatusOr<const ServedModel*> versioned =
        FindVersion(request->model_name(), request->model_version());
    if (!versioned.ok()) return versioned.status();
    return DecodeInferRequest(*request, model.model.dims, dispatcher_.limits(), *outputs);
  };
  auto respond = [request, response, outputs](const ServedModel&, const ResultLayout& layout,
                                              const AttentionResult& result) {
    FillInferResponse(*request, *outputs, layout, result, response);
  };
  dispatcher_.Dispatch(context, reactor, request->model_name(), kApiKserve, decode,
                       std::move(respond));
  return reactor;
}

}  // namespace mha::server
