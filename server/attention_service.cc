#include "server/attention_service.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mha::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status AttentionServiceImpl::Authorize(const grpc::CallbackServerContext& context) const {
  if (!auth_.enabled()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return auth_.Check("");
  return auth_.Check(absl::string_view(it->second.data(), it->second.size()));
}

absl::StatusOr<const ServedModel*> AttentionServiceImpl::ServingModel(
    const std::string& name) const {
  absl::StatusOr<const ServedModel*> model = models_.Find(name);
  if (!model.ok()) return model;
  if (!(*model)->load_status.ok()) return (*model)->load_status;
  return model;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  absl::StatusOr<const ServedModel*> found = ServingModel(request->model());
  // Series exist for the repository's models only: a client naming random
  // models must not create label values.
  const bool known = models_.Find(request->model()).ok();
  const std::string label = known ? request->model() : kUnknownModelLabel;
  ModelMetrics* model_metrics = known ? &metrics_.ForModel(label) : nullptr;
  if (model_metrics != nullptr) model_metrics->inflight->Increment();
  // Records the outcome and answers; called exactly once per call.
  auto finish = [this, context, reactor, start, label, model_metrics](const absl::Status& status) {
    const absl::Duration took = absl::Now() - start;
    metrics_.CountRequest(label, status.code());
    if (model_metrics != nullptr) {
      model_metrics->request_duration->Observe(absl::ToDoubleSeconds(took));
      model_metrics->inflight->Decrement();
    }
    // Handler in to response out, for clients that report it.
    context->AddTrailingMetadata(std::string(kServerTimeMetadata),
                                 std::to_string(absl::ToInt64Microseconds(took)));
    reactor->Finish(ToGrpcStatus(status));
  };
  if (draining_) {
    finish(absl::UnavailableError("server is shutting down"));
    return reactor;
  }
  if (absl::Status allowed = Authorize(*context); !allowed.ok()) {
    finish(allowed);
    return reactor;
  }
  if (!found.ok()) {
    finish(found.status());
    return reactor;
  }
  const ServedModel& model = **found;
  absl::StatusOr<DecodedRequest> decoded =
      DecodeAttendRequest(*request, model.model.dims, limits_);
  if (!decoded.ok()) {
    finish(decoded.status());
    return reactor;
  }
  auto pending = std::make_unique<PendingRequest>(std::move(*decoded));
  pending->deadline = absl::FromChrono(context->deadline());
  pending->cancelled = [context] { return context->IsCancelled(); };
  const v1::DataType out_dtype = pending->input.output_dtype;
  const std::vector<int64_t> out_shape = pending->input.output_shape;
  const std::vector<int64_t> weights_shape = pending->input.weights_shape;
  pending->done = [finish, response, out_dtype, out_shape, weights_shape,
                   name = model.name](absl::StatusOr<AttentionResult> result) {
    if (result.ok()) {
      response->set_model(name);
      EncodeTensor(result->output.data(), out_shape, out_dtype, response->mutable_output());
      if (!weights_shape.empty()) {
        EncodeTensor(result->weights.data(), weights_shape, v1::DATA_TYPE_FP32,
                     response->mutable_attn_weights());
      }
    }
    finish(result.status());
  };
  const absl::Status queued = model.batcher->Enqueue(pending);
  if (!queued.ok()) finish(queued);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status allowed = Authorize(*context);
  if (allowed.ok()) {
    for (const ServedModel* m : models_.All()) *response->add_models() = m->info;
  }
  reactor->Finish(ToGrpcStatus(allowed));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = Authorize(*context); !allowed.ok()) {
    reactor->Finish(ToGrpcStatus(allowed));
    return reactor;
  }
  absl::StatusOr<const ServedModel*> model = models_.Find(request->name());
  if (model.ok()) *response = (*model)->info;
  reactor->Finish(ToGrpcStatus(model.status()));
  return reactor;
}

}  // namespace mha::server
