#include "server/frontends/common/front_end_gate.h"

#include <algorithm>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/scheduling/admission.h"

namespace mha::server {

absl::Time CallDeadline(absl::Time transport_deadline, absl::Time arrived, absl::Duration timeout) {
  return std::min(transport_deadline, arrived + timeout);
}

absl::Status FrontEndGate::Admit(absl::string_view authorization) const {
  if (draining_) return absl::UnavailableError("server is shutting down");
  return Authorize(authorization);
}

absl::Status DispatchedCall::Encode(const AttentionResult& result) {
  return EncodeResult(*version_, layout_, result);
}

void DispatchedCall::Finish(const absl::Status& status) {
  const absl::Duration took = absl::Now() - arrived;
  if (model_metrics_ != nullptr) {
    model_metrics_->CountRequest(api_, status.code());
  } else if (metrics_ != nullptr) {
    metrics_->CountUnknownModelRequest(api_, status.code());
  }
  if (model_metrics_ != nullptr) {
    model_metrics_->request_duration->Observe(absl::ToDoubleSeconds(took));
    model_metrics_->inflight->Decrement();
  }
  Send(status, took);
}

absl::StatusOr<VersionPtr> FrontEndGate::Track(DispatchedCall& c, const std::string& model_name,
                                               int64_t version, const char* api) const {
  c.metrics_ = &metrics_;
  c.api_ = api;
  c.arrived = absl::Now();
  absl::StatusOr<VersionPtr> found = models_.Find(model_name, version);
  // Series exist for the repository's models only: a client naming random
  // models must not create label values. A request that reached no version
  // of a known model counts under version "".
  c.model_metrics_ = found.ok()                ? (*found)->metrics.get()
                     : models_.Has(model_name) ? &metrics_.ForModel(model_name)
                                               : nullptr;
  if (c.model_metrics_ != nullptr) c.model_metrics_->inflight->Increment();
  return found;
}

void FrontEndGate::CountRefused(const std::string& model_name, int64_t version, const char* api,
                                absl::StatusCode code) const {
  absl::StatusOr<VersionPtr> found = models_.Find(model_name, version);
  if (found.ok()) {
    (*found)->metrics->CountRequest(api, code);
  } else if (models_.Has(model_name)) {
    metrics_.ForModel(model_name).CountRequest(api, code);
  } else {
    metrics_.CountUnknownModelRequest(api, code);
  }
}

void FrontEndGate::Dispatch(std::unique_ptr<DispatchedCall> call, const std::string& model_name,
                            int64_t version, const char* api) {
  DispatchedCall& c = *call;
  absl::StatusOr<VersionPtr> found = Track(c, model_name, version, api);
  if (found.ok()) {
    c.statistics = (*found)->statistics.get();
    c.version_ = *found;
  }
  absl::Status admitted = Admit(c.Authorization());
  if (admitted.ok()) admitted = found.status();
  if (!admitted.ok()) return c.Fail(admitted);
  const ModelVersion& model = **found;
  try {
    absl::StatusOr<AttentionRequest> decoded = c.Decode(model);
    if (!decoded.ok()) return c.Fail(decoded.status());
    c.SetInput(*std::move(decoded));
  } catch (const std::bad_alloc&) {
    return c.Fail(absl::ResourceExhaustedError("out of memory decoding the request; retry later"));
  }
  // What it will cost, from its shapes, before it takes memory or time.
  const AttentionRequest& input = c.input();
  const RequestCost cost = CostOf(input, *model.loaded.engine, model.batcher->MaxThreadsPerCall());
  if (absl::Status s = CheckResponseSize(input, cost, limits_.max_message_bytes); !s.ok()) {
    c.model_metrics_->CountDropped("message_size");
    return c.Fail(s);
  }
  c.queued_bytes = cost.queued_bytes;
  c.active_bytes = cost.active_bytes;
  c.Hold(c.memory);
  c.deadline = CallDeadline(c.TransportDeadline(), c.arrived, c.timeout_);
  c.layout_ = ResultLayout{input.output_dtype(), input.output_shape(), input.weights_shape()};
  model.batcher->Enqueue(std::move(call));  // answers the call, whatever happens
}

}  // namespace mha::server
