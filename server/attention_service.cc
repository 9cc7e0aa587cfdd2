#include "server/attention_service.h"

#include <utility>

#include "engine/status_macros.h"

namespace mha::server {

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  auto* reactor = new CallReactor();
  auto decode = [this, request](const ModelVersion& model) {
    return DecodeAttendRequest(*request, model.model.dims, dispatcher_.limits());
  };
  auto respond = [response](const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) {
    response->set_model(model.name);
    response->set_model_version(model.version);
    EncodeTensor(result.output, layout.output_shape, layout.output_dtype,
                 response->mutable_output());
    if (!layout.weights_shape.empty()) {
      EncodeTensor(result.weights, layout.weights_shape, DType::kF32,
                   response->mutable_attn_weights());
    }
  };
  dispatcher_.Dispatch(context, reactor, request->model(), request->model_version(), kApiMha,
                       decode, std::move(respond));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status allowed = dispatcher_.Authorize(*context);
  if (allowed.ok()) {
    for (v1::ModelInfo& info : dispatcher_.models().Infos()) {
      *response->add_models() = std::move(info);
    }
  }
  reactor->Finish(ToGrpcStatus(allowed));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = dispatcher_.Authorize(*context); !allowed.ok()) {
    reactor->Finish(ToGrpcStatus(allowed));
    return reactor;
  }
  absl::StatusOr<v1::ModelInfo> info = dispatcher_.models().Info(request->name());
  if (info.ok()) *response = *std::move(info);
  reactor->Finish(ToGrpcStatus(info.status()));
  return reactor;
}

absl::Status AttentionServiceImpl::ControlAllowed(
    const grpc::CallbackServerContext& context) const {
  RETURN_IF_ERROR(dispatcher_.Authorize(context));
  if (control_.mode() == ModelControlMode::kNone) {
    return absl::FailedPreconditionError(
        "model control is off: start the server with --model_control_mode explicit (or poll) "
        "to load and unload models over the API");
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadModel(grpc::CallbackServerContext* context,
                                                          const v1::LoadModelRequest* request,
                                                          v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = ControlAllowed(*context); !allowed.ok()) {
    reactor->Finish(ToGrpcStatus(allowed));
    return reactor;
  }
  const ModelRepository& models = dispatcher_.models();
  control_.Load(request->name(), [reactor, response, &models,
                                  name = request->name()](absl::Status status) {
    if (absl::StatusOr<v1::ModelInfo> info = models.Info(name); info.ok()) {
      *response = *std::move(info);
    }
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadModel(
    grpc::CallbackServerContext* context, const v1::UnloadModelRequest* request,
    v1::UnloadModelResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = ControlAllowed(*context); !allowed.ok()) {
    reactor->Finish(ToGrpcStatus(allowed));
    return reactor;
  }
  control_.Unload(request->name(),
                  [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

}  // namespace mha::server
