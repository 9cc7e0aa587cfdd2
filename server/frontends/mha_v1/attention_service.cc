#include "server/frontends/mha_v1/attention_service.h"

#include <memory>
#include <utility>

#include "engine/status_macros.h"
#include "engine/weights.h"
#include "engine/wire_dtype.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "server/frontends/common/statistics_fill.h"
#include "server/frontends/grpc/wire_responses.h"
#include "server/frontends/mha_v1/stream_reactor.h"
#include "wire/wire_reader.h"

namespace mha::server {
namespace {

void FillStatistics(const ModelVersion& version, v1::ModelVersionStatistics* out) {
  const ModelStatistics::Snapshot s = version.statistics->Read();
  out->set_name(version.name);
  out->set_version(version.version);
  out->set_last_inference_ms(s.last_inference_ms);
  out->set_inference_count(s.inference_count);
  out->set_execution_count(s.execution_count);
  FillStages(s, out);
  for (const auto& [requests, stages] : s.batches) {
    v1::BatchStatistics* batch = out->add_batches();
    batch->set_requests(requests);
    FillComputeStages(stages, batch);
  }
}

// ListModels' and GetModel's description of a model in the table.
v1::ModelInfo ToModelInfo(const ModelStatus& status, const RequestLimits& limits) {
  v1::ModelInfo info;
  info.set_name(status.name);
  info.set_max_message_bytes(limits.max_message_bytes);
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
  const LoadedModel& newest = status.newest->loaded;
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

AttentionServiceImpl::AttentionServiceImpl(FrontEndGate& gate, ModelControl& control,
                                           SessionManager& sessions)
    : gate_(gate), control_(control), sessions_(sessions), session_calls_(gate, sessions) {
  MarkMethodRawCallback(
      MethodIndex(*v1::AttendRequest::descriptor()->file(), "AttentionService", "Stream"),
      new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
          [this](grpc::CallbackServerContext* context) {
            return new StreamReactor(context, gate_, session_calls_);
          }));
}

namespace {

// A received Attend request, read around its tensor bytes (proto/wire/),
// with where its tensors' data are for the decoder.
struct ReceivedAttend : wire::ReceivedMessage<v1::AttendRequest> {
  AttendReceived data{};

  absl::Status Read(const grpc::ByteBuffer& buffer) {
    RETURN_IF_ERROR(ReceivedMessage::Read(buffer, wire::kAttendRequestPayloads, "AttendRequest"));
    for (int i = 0; i < 5; ++i) {
      const int path[] = {i + 2, 3};
      data[i] = Payload(path);
    }
    return absl::OkStatus();
  }
};

// An Attend request and its response, written around the output's bytes;
// UnaryCall answers it through its reactor, which holds the memory until the
// response is sent.
class AttendRequestCall : public DispatchedCall {
 public:
  AttendRequestCall(std::unique_ptr<ReceivedAttend> request, grpc::ByteBuffer* response,
                    const FrontEndGate& gate)
      : request_(std::move(request)), response_(response), gate_(gate) {}

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override {
    return DecodeAttendRequest(request_->fields, model.loaded.dims, gate_.limits(), request_->data);
  }
  bool SendsConvertedOutput() const override { return true; }  // WriteAttendResponse

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    *response_ = AttendResponseBytes(model.name, model.version, layout, result);
    return absl::OkStatus();
  }

  const std::unique_ptr<ReceivedAttend> request_;
  grpc::ByteBuffer* const response_;
  const FrontEndGate& gate_;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  auto received = std::make_unique<ReceivedAttend>();
  if (absl::Status read = received->Read(*request); !read.ok()) {
    return FinishUnary(context, read);
  }
  const std::string model = received->fields.model();
  const int64_t version = received->fields.model_version();
  auto* reactor = new CallReactor();
  gate_.Dispatch(std::make_unique<UnaryCall<AttendRequestCall>>(
                     context, reactor, std::move(received), response, gate_),
                 model, version, kApiMha);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* response) {
  const absl::Status allowed = gate_.Authorize(AuthorizationOf(*context));
  if (allowed.ok()) {
    for (const ModelStatus& status : gate_.models().Statuses()) {
      *response->add_models() = ToModelInfo(status, gate_.limits());
    }
  }
  return FinishUnary(context, allowed);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelInfo* response) {
  if (absl::Status allowed = gate_.Authorize(AuthorizationOf(*context)); !allowed.ok()) {
    return FinishUnary(context, allowed);
  }
  absl::StatusOr<ModelStatus> status = gate_.models().Status(request->name());
  if (status.ok()) *response = ToModelInfo(*status, gate_.limits());
  return FinishUnary(context, status.status());
}

absl::Status AttentionServiceImpl::ControlAllowed(
    const grpc::CallbackServerContext& context) const {
  RETURN_IF_ERROR(gate_.Authorize(AuthorizationOf(context)));
  return control_.Allowed();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadModel(grpc::CallbackServerContext* context,
                                                          const v1::LoadModelRequest* request,
                                                          v1::ModelInfo* response) {
  if (absl::Status allowed = ControlAllowed(*context); !allowed.ok()) {
    return FinishUnary(context, allowed);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const ModelRepository& models = gate_.models();
  const RequestLimits& limits = gate_.limits();
  control_.Load(request->name(),
                [reactor, response, &models, &limits, name = request->name()](absl::Status status) {
                  if (absl::StatusOr<ModelStatus> model = models.Status(name); model.ok()) {
                    *response = ToModelInfo(*model, limits);
                  }
                  reactor->Finish(ToGrpcStatus(status));
                });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadModel(grpc::CallbackServerContext* context,
                                                            const v1::UnloadModelRequest* request,
                                                            v1::UnloadModelResponse*) {
  if (absl::Status allowed = ControlAllowed(*context); !allowed.ok()) {
    return FinishUnary(context, allowed);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  control_.Unload(request->name(), FinisherOf(reactor));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModelStatistics(
    grpc::CallbackServerContext* context, const v1::GetModelStatisticsRequest* request,
    v1::ModelStatisticsResponse* response) {
  absl::Status status = gate_.Authorize(AuthorizationOf(*context));
  if (status.ok()) {
    absl::StatusOr<std::vector<VersionPtr>> selected =
        gate_.models().Select(request->name(), request->version());
    status = selected.status();
    if (selected.ok()) {
      for (const VersionPtr& v : *selected) FillStatistics(*v, response->add_models());
    }
  }
  return FinishUnary(context, status);
}

}  // namespace mha::server
