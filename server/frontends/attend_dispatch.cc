#include "server/frontends/attend_dispatch.h"

#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/scheduling/admission.h"

namespace mha::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status AttendDispatcher::Authorize(const grpc::CallbackServerContext& context) const {
  if (!auth_.enabled()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return auth_.Check("");
  return auth_.Check(absl::string_view(it->second.data(), it->second.size()));
}

AttendDispatcher::Completion UnaryCompletion(grpc::CallbackServerContext* context,
                                             CallReactor* reactor) {
  AttendDispatcher::Completion completion;
  completion.hold = [reactor](std::shared_ptr<MemoryReservation> memory) {
    reactor->Hold(std::move(memory));
  };
  completion.finish = [context, reactor](const absl::Status& status, absl::Duration took) {
    context->AddTrailingMetadata(std::string(kServerTimeMetadata),
                                 std::to_string(absl::ToInt64Microseconds(took)));
    reactor->Finish(ToGrpcStatus(status));
  };
  return completion;
}

void AttendDispatcher::Dispatch(grpc::CallbackServerContext* context, CallReactor* reactor,
                                const std::string& model_name, int64_t version,
                                const char* api, const Decoder& decode, Responder respond) {
  Dispatch(context, UnaryCompletion(context, reactor), model_name, version, api, decode,
           std::move(respond));
}

void AttendDispatcher::Dispatch(grpc::CallbackServerContext* context, Completion completion,
                                const std::string& model_name, int64_t version,
                                const char* api, const Decoder& decode, Responder respond) {
  const absl::Time start = absl::Now();
  absl::StatusOr<VersionPtr> found = models_.Find(model_name, version);
  // Series exist for the repository's models only: a client naming random
  // models must not create label values. A request that reached no version
  // of a known model counts under version "".
  ModelMetrics* model_metrics = found.ok()                ? (*found)->metrics.get()
                                : models_.Has(model_name) ? &metrics_.ForModel(model_name)
                                                          : nullptr;
  if (model_metrics != nullptr) model_metrics->inflight->Increment();
  // The version's statistics, alive while `found` or a request holds it.
  ModelStatistics* statistics = found.ok() ? (*found)->statistics.get() : nullptr;
  auto sequences = std::make_shared<int64_t>(0);  // known once decoded
  // Records the outcome and answers; called exactly once per call.
  auto finish = [this, answer = std::move(completion.finish), start, api, model_metrics,
                 statistics, sequences](const absl::Status& status) {
    const absl::Duration took = absl::Now() - start;
    if (model_metrics != nullptr) {
      model_metrics->CountRequest(api, status.code());
    } else {
      metrics_.CountUnknownModelRequest(api, status.code());
    }
    if (statistics != nullptr) statistics->RequestDone(status.ok(), took, *sequences);
    if (model_metrics != nullptr) {
      model_metrics->request_duration->Observe(absl::ToDoubleSeconds(took));
      model_metrics->inflight->Decrement();
    }
    answer(status, took);
  };
  absl::Status admitted = draining_ ? absl::UnavailableError("server is shutting down")
                                    : Authorize(*context);
  if (admitted.ok()) admitted = found.status();
  if (!admitted.ok()) return finish(admitted);
  const ModelVersion& model = **found;
  std::unique_ptr<PendingRequest> pending;
  try {
    absl::StatusOr<AttentionRequest> decoded = decode(model);
    if (!decoded.ok()) return finish(decoded.status());
    *sequences = decoded->sequences();
    pending = std::make_unique<PendingRequest>(std::move(*decoded));
  } catch (const std::bad_alloc&) {
    return finish(absl::ResourceExhaustedError("out of memory decoding the request; retry later"));
  }
  // What it will cost, from its shapes, before it takes memory or time.
  const RequestCost cost = CostOf(pending->input, *model.model.engine,
                                  model.batcher->ThreadsPerCall());
  if (absl::Status s = CheckResponseSize(pending->input, cost, limits_.max_message_bytes);
      !s.ok()) {
    model_metrics->CountDropped("message_size");
    return finish(s);
  }
  if (absl::Status s = CheckWorkingMemory(pending->input, cost, memory_.capacity()); !s.ok()) {
    model_metrics->CountDropped("memory");
    return finish(s);
  }
  pending->queued_bytes = cost.queued_bytes;
  pending->active_bytes = cost.active_bytes;
  completion.hold(pending->memory);
  pending->deadline = absl::FromChrono(context->deadline());
  pending->cancelled = [context] { return context->IsCancelled(); };
  ResultLayout layout{pending->input.output_dtype(), pending->input.output_shape(),
                      pending->input.weights_shape()};
  pending->done = [finish, respond = std::move(respond), layout = std::move(layout),
                   held = *found](absl::StatusOr<AttentionResult> result) {
    absl::Status status = result.status();
    if (result.ok()) {
      try {
        respond(*held, layout, *result);
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError("out of memory encoding the response; retry later");
      }
    }
    finish(status);
  };
  model.batcher->Enqueue(std::move(pending));  // answers through done, whatever happens
}

}  // namespace mha::server
