#include "server/attention_service.h"

namespace mha::server {

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  auto* reactor = new CallReactor();
  auto decode = [this, request](const ServedModel& model) {
    return DecodeAttendRequest(*request, model.model.dims, dispatcher_.limits());
  };
  auto respond = [response](const ServedModel& model, const ResultLayout& layout,
                            const AttentionResult& result) {
    response->set_model(model.name);
    EncodeTensor(result.output, layout.output_shape, layout.output_dtype,
                 response->mutable_output());
    if (!layout.weights_shape.empty()) {
      EncodeTensor(result.weights, layout.weights_shape, DType::kF32,
                   response->mutable_attn_weights());
    }
  };
  dispatcher_.Dispatch(context, reactor, request->model(), kApiMha, decode, std::move(respond));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status allowed = dispatcher_.Authorize(*context);
  if (allowed.ok()) {
    for (const ServedModel* m : dispatcher_.models().All()) *response->add_models() = m->info;
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
  absl::StatusOr<const ServedModel*> model = dispatcher_.models().Find(request->name());
  if (model.ok()) *response = (*model)->info;
  reactor->Finish(ToGrpcStatus(model.status()));
  return reactor;
}

}  // namespace mha::server
