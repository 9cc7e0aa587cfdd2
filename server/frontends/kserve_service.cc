#include "server/frontends/kserve_service.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mha/v1/model_config.pb.h"
#include "server/frontends/kserve_codec.h"
#include "server/frontends/message_stream.h"
#include "server/frontends/statistics_fill.h"
#include "server/frontends/triton_config.h"

#ifndef MHA_VERSION
#define MHA_VERSION "0"
#endif

namespace mha::server {
namespace {

void FillStatistics(const ModelVersion& version, inference::ModelStatistics* out) {
  const ModelStatistics::Snapshot s = version.statistics->Read();
  out->set_name(version.name);
  out->set_version(absl::StrCat(version.version));
  out->set_last_inference(s.last_inference_ms);
  out->set_inference_count(s.inference_count);
  out->set_execution_count(s.execution_count);
  inference::InferStatistics* stats = out->mutable_inference_stats();
  FillStages(s, stats);
  for (const auto& [sequences, stages] : s.batch_sizes) {
    inference::InferBatchStatistics* batch = out->add_batch_stats();
    batch->set_batch_size(sequences);
    FillComputeStages(stages, batch);
  }
}

}  // namespace

absl::StatusOr<VersionPtr> KserveServiceImpl::FindVersion(const std::string& name,
                                                          const std::string& version) const {
  absl::StatusOr<int64_t> number = ParseModelVersion(name, version);
  if (!number.ok()) return number.status();
  return gate_.models().Find(name, *number);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerReady(grpc::CallbackServerContext* context,
                                                         const inference::ServerReadyRequest*,
                                                         inference::ServerReadyResponse* response) {
  response->set_ready(!gate_.draining());  // as grpc.health.v1's overall status
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  absl::StatusOr<VersionPtr> model = FindVersion(request->name(), request->version());
  // As Triton: a model (or version) that is unknown, unloaded or failed to
  // load is not ready, and that is an answer, not an error.
  if (absl::IsFailedPrecondition(model.status()) || absl::IsNotFound(model.status())) {
    response->set_ready(false);
    return FinishUnary(context, absl::OkStatus());
  }
  if (model.ok()) response->set_ready(!gate_.draining());
  return FinishUnary(context, model.status());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  const absl::Status allowed = gate_.Authorize(*context);
  if (allowed.ok()) {
    response->set_name("mha-serve");
    response->set_version(MHA_VERSION);
    // Of the protocol's optional extensions: request parameters (is_causal,
    // need_weights, per_head_weights), and Triton's model repository (with
    // --model_control_mode poll or explicit), statistics, ModelConfig,
    // timeout and priority, sequences (on sessions) and system shared memory.
    response->add_extensions("parameters");
    response->add_extensions("model_repository");
    response->add_extensions("statistics");
    response->add_extensions("model_configuration");
    response->add_extensions("schedule_policy");
    response->add_extensions("sequence");
    response->add_extensions("system_shared_memory");
  }
  return FinishUnary(context, allowed);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::Status status = gate_.Authorize(*context);
  if (status.ok()) {
    absl::StatusOr<VersionPtr> model = FindVersion(request->name(), request->version());
    status = model.status();
    if (status.ok()) {
      DescribeModel((*model)->name, (*model)->loaded.dims,
                    gate_.models().ReadyVersions(request->name()), response);
    }
  }
  return FinishUnary(context, status);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  absl::Status status = gate_.Authorize(*context);
  if (status.ok()) {
    absl::StatusOr<VersionPtr> model = FindVersion(request->name(), request->version());
    // Triton: NOT_FOUND for a model that is unknown, unloaded or not ready.
    if (absl::IsFailedPrecondition(model.status())) {
      status = absl::NotFoundError(
          absl::StrCat("model '", request->name(), "' is not ready: ", model.status().message()));
    } else {
      status = model.status();
    }
    if (status.ok()) {
      DescribeTritonConfig(**model, gate_.limits().max_tokens, response->mutable_config());
    }
  }
  return FinishUnary(context, status);
}

// A ModelInfer request as a call: decoded and encoded the KServe way (the
// outputs it asks for, in their order); how its answer leaves is the
// transport's. `request` and `response` live until the answer is sent.
class KserveServiceImpl::InferCall : public DispatchedCall {
 public:
  InferCall(const inference::ModelInferRequest& request, inference::ModelInferResponse* response,
            const KserveServiceImpl& service)
      : request_(request),
        response_(response),
        gate_(service.gate_),
        shared_memory_(service.shared_memory_),
        version_(ParseModelVersion(request.model_name(), request.model_version())),
        call_parameters_(ReadCallParameters(request)),
        arrival_(absl::Now()) {}

  const inference::ModelInferRequest& request() const { return request_; }
  // An unparsable version is refused by Decode, so that it is counted and
  // answered like every other refusal.
  int64_t version() const { return version_.value_or(0); }

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override {
    if (!version_.ok()) return version_.status();
    if (!call_parameters_.ok()) return call_parameters_.status();
    LimitTime(call_parameters_->timeout);
    priority = call_parameters_->priority;
    return DecodeInferRequest(request_, model.loaded.dims, gate_.limits(), &shared_memory_,
                              outputs_);
  }
  // Whether each response should say it is its request's last (known
  // before anything else, so that an early error says it too).
  bool final_response_flag() const {
    return call_parameters_.ok() && call_parameters_->final_response_flag;
  }

  // Triton's sequence parameters when the request names a sequence (and
  // its parameters read well), else null.
  const InferCallParameters* sequence_parameters() const {
    return call_parameters_.ok() && call_parameters_->sequence.has_value() ? &*call_parameters_
                                                                           : nullptr;
  }
  inference::ModelInferResponse* response() const { return response_; }
  // The earlier of `context`'s deadline and the request's own timeout.
  absl::Time Deadline(const grpc::CallbackServerContext& context) const {
    return std::min(absl::FromChrono(context.deadline()),
                    arrival_ + call_parameters_.value_or(InferCallParameters{}).timeout);
  }

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    return FillInferResponse(request_, model.version, outputs_, layout, result, response_);
  }

  const inference::ModelInferRequest& request_;
  inference::ModelInferResponse* const response_;
  const FrontEndGate& gate_;
  const SharedMemoryRegistry& shared_memory_;
  const absl::StatusOr<int64_t> version_;
  const absl::StatusOr<InferCallParameters> call_parameters_;
  const absl::Time arrival_;
  std::vector<RequestedOutput> outputs_;  // as requested, known once decoded
};

grpc::ServerUnaryReactor* KserveServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const inference::ModelInferRequest* request,
                                                        inference::ModelInferResponse* response) {
  auto* reactor = new CallReactor();
  StartInfer(context,
             std::make_unique<UnaryCall<InferCall>>(context, reactor, *request, response, *this));
  return reactor;
}

void KserveServiceImpl::StartInfer(grpc::CallbackServerContext* context,
                                   std::unique_ptr<InferCall> call) {
  if (const InferCallParameters* sequence = call->sequence_parameters(); sequence != nullptr) {
    // Owned by the step's callback until it has answered. The gate
    // tracks it as every call (metrics, in flight); its session step computes
    // it, and it answers through Answer, once.
    std::shared_ptr<InferCall> owned = std::move(call);
    (void)gate_.Track(context, *owned, owned->request().model_name(), owned->version(), kApiKserve);
    sequences_.Infer(*context, owned->request(), *sequence, owned->Deadline(*context),
                     owned->response(),
                     [owned](const absl::Status& status) { owned->Answer(status); });
    return;
  }
  const std::string model = call->request().model_name();
  const int64_t version = call->version();
  gate_.Dispatch(context, std::move(call), model, version, kApiKserve);
}

// One ModelStreamInfer call: each request runs as ModelInfer does; an error
// is its answer's error_message (with the request's id and model name).
class KserveServiceImpl::InferStream final
    : public MessageStream<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
 public:
  InferStream(grpc::CallbackServerContext* context, KserveServiceImpl& service)
      : context_(context), service_(service) {
    StartReading();
  }

 private:
  // A request of the stream; it keeps its message alive until answered.
  class Message final : public InferCall {
   public:
    Message(InferStream& stream, std::shared_ptr<inference::ModelInferRequest> request,
            std::shared_ptr<Outbound> out)
        : InferCall(*request, out->response.mutable_infer_response(), stream.service_),
          stream_(stream),
          message_(std::move(request)),
          out_(std::move(out)) {}

   private:
    void Send(const absl::Status& status, absl::Duration) override {
      inference::ModelInferResponse* infer = out_->response.mutable_infer_response();
      if (!status.ok()) {
        out_->response.set_error_message(MessageOf(status));
        infer->Clear();
        infer->set_id(message_->id());
        infer->set_model_name(message_->model_name());
        infer->set_model_version(message_->model_version());
      }
      if (final_response_flag()) {  // one response per request: the last
        (*infer->mutable_parameters())["triton_final_response"].set_bool_param(true);
      }
      stream_.Reply(out_);
    }
    void Hold(std::shared_ptr<MemoryReservation> memory) override {
      out_->memory = std::move(memory);
    }

    InferStream& stream_;
    const std::shared_ptr<inference::ModelInferRequest> message_;
    const std::shared_ptr<Outbound> out_;
  };

  void Start(std::shared_ptr<inference::ModelInferRequest> request) override {
    auto out = std::make_shared<Outbound>();
    service_.StartInfer(context_, std::make_unique<Message>(*this, std::move(request), out));
  }

  grpc::CallbackServerContext* const context_;
  KserveServiceImpl& service_;
};

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
KserveServiceImpl::ModelStreamInfer(grpc::CallbackServerContext* context) {
  return new InferStream(context, *this);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  absl::Status status = gate_.Authorize(*context);
  absl::StatusOr<int64_t> version = ParseModelVersion(request->name(), request->version());
  if (status.ok()) status = version.status();
  if (status.ok()) {
    absl::StatusOr<std::vector<VersionPtr>> selected =
        gate_.models().Select(request->name(), *version);
    status = selected.status();
    if (selected.ok()) {
      for (const VersionPtr& v : *selected) FillStatistics(*v, response->add_model_stats());
    }
  }
  return FinishUnary(context, status);
}

}  // namespace mha::server
