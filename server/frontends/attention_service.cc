#include "server/frontends/attention_service.h"

#include <memory>
#include <utility>

#include "engine/status_macros.h"
#include "engine/weights.h"
#include "server/frontends/stream_reactor.h"

namespace mha::server {
namespace {

void Fill(const ModelStatistics::Duration& d, v1::StageDuration* out) {
  out->set_count(d.count);
  out->set_ns(d.ns);
}

void FillStatistics(const ModelVersion& version, v1::ModelVersionStatistics* out) {
  const ModelStatistics::Snapshot s = version.statistics->Read();
  out->set_name(version.name);
  out->set_version(version.version);
  out->set_last_inference_ms(s.last_inference_ms);
  out->set_inference_count(s.inference_count);
  out->set_execution_count(s.execution_count);
  Fill(s.success, out->mutable_success());
  Fill(s.fail, out->mutable_fail());
  Fill(s.queue, out->mutable_queue());
  Fill(s.compute_input, out->mutable_compute_input());
  Fill(s.compute_infer, out->mutable_compute_infer());
  Fill(s.compute_output, out->mutable_compute_output());
  for (const auto& [requests, stages] : s.batches) {
    v1::BatchStatistics* batch = out->add_batches();
    batch->set_requests(requests);
    Fill(stages.compute_input, batch->mutable_compute_input());
    Fill(stages.compute_infer, batch->mutable_compute_infer());
    Fill(stages.compute_output, batch->mutable_compute_output());
  }
}

// ListModels' and GetModel's description of a model in the table.
v1::ModelInfo ToModelInfo(const ModelStatus& status) {
  v1::ModelInfo info;
  info.set_name(status.name);
  info.set_error(status.error);
  for (const ModelStatus::Version& v : status.versions) {
    v1::ModelVersionStatus* version = info.add_versions();
    version->set_version(v.version);
    version->set_state(v.ready ? v1::ModelInfo::STATE_READY : v1::ModelInfo::STATE_FAILED);
    version->set_error(v.error);
  }
  if (status.newest == nullptr) {
    info.set_state(v1::ModelInfo::STATE_FAILED);
    return info;
  }
  const LoadedModel& newest = status.newest->model;
  info.set_state(v1::ModelInfo::STATE_READY);
  *info.mutable_config() = newest.config;
  info.set_weight_layout(WeightLayoutName(newest.layout));
  info.set_parameter_count(newest.parameter_count);
  info.set_embed_dim(newest.dims.embed_dim);
  info.set_num_heads(newest.dims.num_heads);
  info.set_kdim(newest.dims.kdim);
  info.set_vdim(newest.dims.vdim);
  return info;
}

}  // namespace

void EncodeAttendResponse(const ModelVersion& model, const ResultLayout& layout,
                          const AttentionResult& result, v1::AttendResponse* response) {
  response->set_model(model.name);
  response->set_model_version(model.version);
  EncodeTensor(result.output, layout.output_shape, layout.output_dtype, response->mutable_output());
  if (!layout.weights_shape.empty()) {
    EncodeTensor(result.weights, layout.weights_shape, DType::kF32,
                 response->mutable_attn_weights());
  }
}

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* AttentionServiceImpl::Stream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(context, dispatcher_, session_calls_);
}

namespace {

// A unary Attend: its reactor holds the memory until the response is sent
// and finishes with the status and the server-time trailer.
class UnaryAttendCall final : public DispatchedCall {
 public:
  UnaryAttendCall(grpc::CallbackServerContext* context, CallReactor* reactor,
                  const v1::AttendRequest* request, v1::AttendResponse* response,
                  const AttendDispatcher& dispatcher)
      : context_(context),
        reactor_(reactor),
        request_(request),
        response_(response),
        dispatcher_(dispatcher) {}

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override {
    return DecodeAttendRequest(*request_, model.model.dims, dispatcher_.limits());
  }

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    EncodeAttendResponse(model, layout, result, response_);
    return absl::OkStatus();
  }
  void Send(const absl::Status& status, absl::Duration took) override {
    SendUnary(context_, reactor_, status, took);
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    reactor_->Hold(std::move(memory));
  }

  grpc::CallbackServerContext* const context_;
  CallReactor* const reactor_;
  const v1::AttendRequest* const request_;
  v1::AttendResponse* const response_;
  const AttendDispatcher& dispatcher_;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  auto* reactor = new CallReactor();
  dispatcher_.Dispatch(
      context, std::make_unique<UnaryAttendCall>(context, reactor, request, response, dispatcher_),
      request->model(), request->model_version(), kApiMha);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status allowed = dispatcher_.Authorize(*context);
  if (allowed.ok()) {
    for (const ModelStatus& status : dispatcher_.models().Statuses()) {
      *response->add_models() = ToModelInfo(status);
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
  absl::StatusOr<ModelStatus> status = dispatcher_.models().Status(request->name());
  if (status.ok()) *response = ToModelInfo(*status);
  reactor->Finish(ToGrpcStatus(status.status()));
  return reactor;
}

absl::Status AttentionServiceImpl::ControlAllowed(
    const grpc::CallbackServerContext& context) const {
  RETURN_IF_ERROR(dispatcher_.Authorize(context));
  return control_.Allowed();
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
  control_.Load(request->name(),
                [reactor, response, &models, name = request->name()](absl::Status status) {
                  if (absl::StatusOr<ModelStatus> model = models.Status(name); model.ok()) {
                    *response = ToModelInfo(*model);
                  }
                  reactor->Finish(ToGrpcStatus(status));
                });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadModel(grpc::CallbackServerContext* context,
                                                            const v1::UnloadModelRequest* request,
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

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModelStatistics(
    grpc::CallbackServerContext* context, const v1::GetModelStatisticsRequest* request,
    v1::ModelStatisticsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = dispatcher_.Authorize(*context);
  if (status.ok()) {
    absl::StatusOr<std::vector<VersionPtr>> selected =
        dispatcher_.models().Select(request->name(), request->version());
    status = selected.status();
    if (selected.ok()) {
      for (const VersionPtr& v : *selected) FillStatistics(*v, response->add_models());
    }
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace mha::server
