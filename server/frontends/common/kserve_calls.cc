#include "server/frontends/common/kserve_calls.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/status_macros.h"
#include "mha/v1/model_config.pb.h"
#include "server/frontends/common/log_settings.h"
#include "server/frontends/common/statistics_fill.h"
#include "server/frontends/common/triton_config.h"

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
  for (const auto& [rows, stages] : s.batch_sizes) {
    inference::InferBatchStatistics* batch = out->add_batch_stats();
    batch->set_batch_size(rows);
    FillComputeStages(stages, batch);
  }
}

}  // namespace

KserveInferCall::KserveInferCall(const inference::ModelInferRequest& request,
                                 inference::ModelInferResponse* response, const KserveCalls& calls)
    : request_(request),
      response_(response),
      gate_(calls.gate_),
      shared_memory_(calls.shared_memory_),
      version_(ParseModelVersion(request.model_name(), request.model_version())),
      call_parameters_(ReadCallParameters(request)),
      arrival_(absl::Now()) {}

absl::StatusOr<AttentionRequest> KserveInferCall::Decode(const ModelVersion& model) {
  if (!version_.ok()) return version_.status();
  if (!call_parameters_.ok()) return call_parameters_.status();
  LimitTime(call_parameters_->timeout);
  priority = call_parameters_->priority;
  return DecodeInferRequest(request_, model.loaded.dims, gate_.limits(), &shared_memory_, outputs_,
                            received_);
}

absl::Time KserveInferCall::Deadline() const {
  return CallDeadline(TransportDeadline(), arrival_,
                      call_parameters_.value_or(InferCallParameters{}).timeout);
}

absl::Status KserveInferCall::EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                                           const AttentionResult& result) {
  return FillInferResponse(request_, model.version, outputs_, layout, result, response_, deferred_);
}

absl::StatusOr<VersionPtr> KserveCalls::FindVersion(const std::string& name,
                                                    const std::string& version) const {
  ASSIGN_OR_RETURN(const int64_t number, ParseModelVersion(name, version));
  return gate_.models().Find(name, number);
}

absl::Status KserveCalls::ServerMetadata(absl::string_view authorization,
                                         inference::ServerMetadataResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  response->set_name("mha-serve");
  response->set_version(MHA_VERSION);
  // Of the protocol's optional extensions: request parameters (is_causal,
  // need_weights, per_head_weights), and Triton's model repository (with
  // --model_control_mode poll or explicit), statistics, ModelConfig,
  // timeout and priority, sequences (on sessions), system shared memory,
  // logging, and over HTTP the binary tensor data extension.
  for (const char* extension :
       {"parameters", "model_repository", "statistics", "model_configuration", "schedule_policy",
        "sequence", "system_shared_memory", "binary_tensor_data", "logging"}) {
    response->add_extensions(extension);
  }
  return absl::OkStatus();
}

absl::Status KserveCalls::LogSettings(absl::string_view authorization,
                                      const inference::LogSettingsRequest& request,
                                      inference::LogSettingsResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  return ApplyLogSettings(request, response);
}

absl::Status KserveCalls::ModelReady(const inference::ModelReadyRequest& request,
                                     inference::ModelReadyResponse* response) const {
  absl::StatusOr<VersionPtr> model = FindVersion(request.name(), request.version());
  if (absl::IsFailedPrecondition(model.status()) || absl::IsNotFound(model.status())) {
    response->set_ready(false);
    return absl::OkStatus();
  }
  if (model.ok()) response->set_ready(Ready());
  return model.status();
}

absl::Status KserveCalls::ModelMetadata(absl::string_view authorization,
                                        const inference::ModelMetadataRequest& request,
                                        inference::ModelMetadataResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  ASSIGN_OR_RETURN(VersionPtr model, FindVersion(request.name(), request.version()));
  DescribeModel(model->name, model->loaded.dims, gate_.models().ReadyVersions(request.name()),
                response);
  return absl::OkStatus();
}

absl::Status KserveCalls::ModelConfig(absl::string_view authorization,
                                      const inference::ModelConfigRequest& request,
                                      inference::ModelConfigResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  absl::StatusOr<VersionPtr> model = FindVersion(request.name(), request.version());
  // Triton: NOT_FOUND for a model that is unknown, unloaded or not ready.
  if (absl::IsFailedPrecondition(model.status())) {
    return absl::NotFoundError(
        absl::StrCat("model '", request.name(), "' is not ready: ", model.status().message()));
  }
  if (!model.ok()) return model.status();
  DescribeTritonConfig(**model, gate_.limits().max_tokens, response->mutable_config());
  return absl::OkStatus();
}

absl::Status KserveCalls::ModelStatistics(absl::string_view authorization,
                                          const inference::ModelStatisticsRequest& request,
                                          inference::ModelStatisticsResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  ASSIGN_OR_RETURN(const int64_t version, ParseModelVersion(request.name(), request.version()));
  ASSIGN_OR_RETURN(std::vector<VersionPtr> selected,
                   gate_.models().Select(request.name(), version));
  for (const VersionPtr& v : selected) FillStatistics(*v, response->add_model_stats());
  return absl::OkStatus();
}

void KserveCalls::StartInfer(std::unique_ptr<KserveInferCall> call, const char* api) {
  if (const InferCallParameters* sequence = call->sequence_parameters(); sequence != nullptr) {
    // Owned by the step's callback until it has answered. The gate
    // tracks it as every call (metrics, in flight); its session step computes
    // it, and it answers through Answer, once.
    std::shared_ptr<KserveInferCall> owned = std::move(call);
    (void)gate_.Track(*owned, owned->request().model_name(), owned->version(), api);
    sequences_.Infer(
        owned->Authorization(), [owned] { return owned->Cancelled(); }, owned->request(), *sequence,
        owned->Deadline(), owned->response(),
        [owned](const absl::Status& status) { owned->Answer(status); });
    return;
  }
  const std::string model = call->request().model_name();
  const int64_t version = call->version();
  gate_.Dispatch(std::move(call), model, version, api);
}

}  // namespace mha::server
