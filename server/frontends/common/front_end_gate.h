// The front-end gate: what every front end (mha.v1 Attend and sessions,
// KServe v2 ModelInfer and Triton sequences, model control, the stream)
// passes through: draining, auth, the model lookup, the request limits, the
// metrics of each call and the hand-off to the model's batcher, which
// admits it. The front ends only translate their wire format.
#ifndef MHA_SERVER_FRONTENDS_FRONT_END_GATE_H_
#define MHA_SERVER_FRONTENDS_FRONT_END_GATE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/frontends/common/auth.h"
#include "server/frontends/common/request_codec.h"
#include "server/models/model_repository.h"
#include "server/observability/metrics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/batcher.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

// The shapes a response needs, taken from the decoded request.
struct ResultLayout {
  DType output_dtype = DType::kF32;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> weights_shape;  // empty unless weights were asked for
};

class FrontEndGate;

// The one rule for a call's deadline: the earlier of its transport's
// (absl::InfiniteFuture() when it has none) and its own time limit from
// its arrival (absl::InfiniteDuration(): none).
absl::Time CallDeadline(absl::Time transport_deadline, absl::Time arrived, absl::Duration timeout);

// An Attend call of one front end and transport (mha.v1 or KServe, over
// gRPC, unary or a stream's message, or over HTTP): it decodes its message
// for the model version found, encodes a result into its response and sends
// the answer. What every call shares is done here, once: it holds its
// version until the answer (so a version replaced or unloaded meanwhile
// still answers it) and records the outcome in the metrics before sending
// (the statistics: AttendCall and the batcher). Its transport answers who
// calls, whether the caller is gone and by when (gRPC's calls from their
// context: grpc_helpers.h's OverGrpc). Owned as its AttendCall.
class DispatchedCall : public AttendCall {
 public:
  // Validates the message for `model`; on the handler thread.
  virtual absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) = 0;
  // The transport's answers: the caller's Authorization value ("Bearer
  // <token>", "" when absent), whether the caller is gone, and the
  // transport's deadline (absl::InfiniteFuture(): none).
  virtual absl::string_view Authorization() const { return {}; }
  bool Cancelled() const override { return false; }
  virtual absl::Time TransportDeadline() const { return absl::InfiniteFuture(); }

 protected:
  // Fills the response from a successful result (on a worker thread).
  virtual absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                                    const AttentionResult& result) = 0;
  // Sends the answer: `status` OK once the response is filled. `took` is
  // handler in to now.
  virtual void Send(const absl::Status& status, absl::Duration took) = 0;
  // Keeps the reservation until the answer has left (it holds the response).
  virtual void Hold(std::shared_ptr<MemoryReservation> memory) = 0;
  // From Decode: the request's own time limit, from its arrival (its
  // deadline: CallDeadline).
  void LimitTime(absl::Duration timeout) { timeout_ = timeout; }

 private:
  friend class FrontEndGate;
  absl::Status Encode(const AttentionResult& result) final;
  void Finish(const absl::Status& status) final;

  // Set by FrontEndGate::Dispatch.
  Metrics* metrics_ = nullptr;
  const char* api_ = "";
  ModelMetrics* model_metrics_ = nullptr;  // null: a model the server does not have
  VersionPtr version_;
  ResultLayout layout_;
  absl::Duration timeout_ = absl::InfiniteDuration();
};

// Borrows the repository and the metrics (both outlive the server) and owns
// the auth check, the limits and the draining flag. Thread-safe; one per
// server, shared by every front end.
class FrontEndGate {
 public:
  // Admission by memory is the batchers' (Batcher::Enqueue, against the
  // budget they reserve in).
  FrontEndGate(const ModelRepository& models, Metrics& metrics, RequestLimits limits,
               BearerAuth auth = {})
      : models_(models), metrics_(metrics), limits_(limits), auth_(std::move(auth)) {}

  // After this, new calls get UNAVAILABLE (Admit) and readiness is false.
  void StartDraining() { draining_ = true; }
  bool draining() const { return draining_; }

  const ModelRepository& models() const { return models_; }
  const RequestLimits& limits() const { return limits_; }

  // The caller's bearer token (`authorization`: the Authorization value,
  // "" when absent) checked against --auth_token_file.
  absl::Status Authorize(absl::string_view authorization) const {
    return auth_.Check(authorization);
  }
  // What starts new work (an Attend call, a session, a step, an import):
  // UNAVAILABLE once draining (the one place that checks it), else
  // Authorize.
  absl::Status Admit(absl::string_view authorization) const;
  // Admits `call` (Admit), finds the version (0: the newest ready one),
  // decodes, costs it and checks that its response fits the message limit
  // (server/scheduling/admission.h), then hands it to the batcher, which
  // admits it by memory; returns at once. The call is answered exactly
  // once: on this thread when it is refused, else on a worker. `api`
  // labels mha_requests_total.
  void Dispatch(std::unique_ptr<DispatchedCall> call, const std::string& model_name,
                int64_t version, const char* api);
  // Opens `call` for an answer that another path computes (a KServe
  // sequence request, answered by its session step): its arrival, its
  // model's series and in-flight gauge, so that its Answer or Fail records
  // mha_requests_total and the duration as every call's does, once. Returns
  // the version found, or why none was.
  absl::StatusOr<VersionPtr> Track(DispatchedCall& call, const std::string& model_name,
                                   int64_t version, const char* api) const;
  // Counts in mha_requests_total a request refused before it became a call
  // (HTTP's body did not decode), under the series a call would have used.
  void CountRefused(const std::string& model_name, int64_t version, const char* api,
                    absl::StatusCode code) const;

 private:
  const ModelRepository& models_;
  Metrics& metrics_;
  const RequestLimits limits_;
  const BearerAuth auth_;
  std::atomic<bool> draining_{false};
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_FRONT_END_GATE_H_
