// What every attention front end (mha.v1 Attend, KServe v2 ModelInfer)
// shares: admission (draining, auth, model state), metrics, and the hand-off
// to the model's batcher. The front ends only translate their wire format.
#ifndef MHA_SERVER_FRONTENDS_ATTEND_DISPATCH_H_
#define MHA_SERVER_FRONTENDS_ATTEND_DISPATCH_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "server/frontends/auth.h"
#include "server/frontends/request_codec.h"
#include "server/models/model_repository.h"
#include "server/observability/metrics.h"
#include "server/scheduling/batcher.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

// Trailing metadata of every attention answer: microseconds from handler in
// to response out.
inline constexpr char kServerTimeMetadata[] = "mha-server-time-us";

// The one conversion from absl::Status to grpc::Status.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The reactor of one attention call. The dispatcher finishes it exactly
// once; it holds the request's memory reservation until gRPC is done with
// the call (response sent, or call cancelled), then deletes itself.
class CallReactor : public grpc::ServerUnaryReactor {
 public:
  void Hold(std::shared_ptr<MemoryReservation> memory) { memory_ = std::move(memory); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<MemoryReservation> memory_;
};

// The shapes a response needs, taken from the decoded request.
struct ResultLayout {
  DType output_dtype = DType::kF32;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> weights_shape;  // empty unless weights were asked for
};

// Borrows the repository and the metrics (both outlive the server) and owns
// the auth check and the draining flag. Thread-safe; one per server, shared
// by the front ends.
class AttendDispatcher {
 public:
  // Validates a call for the model version found; runs on the handler thread.
  using Decoder = std::function<absl::StatusOr<AttentionRequest>(const ModelVersion&)>;
  // Fills the response from a successful result; runs on a batcher worker.
  using Responder = std::function<void(const ModelVersion&, const ResultLayout&,
                                       const AttentionResult&)>;

  // `memory` (borrowed, outlives the dispatcher) is the budget the
  // batchers reserve in; admission refuses a request that alone exceeds it.
  AttendDispatcher(const ModelRepository& models, Metrics& metrics, RequestLimits limits,
                   const MemoryBudget& memory, BearerAuth auth = {})
      : models_(models),
        metrics_(metrics),
        limits_(limits),
        memory_(memory),
        auth_(std::move(auth)) {}

  // After this, new attention calls get UNAVAILABLE and readiness is false.
  void StartDraining() { draining_ = true; }
  bool draining() const { return draining_; }

  const ModelRepository& models() const { return models_; }
  const RequestLimits& limits() const { return limits_; }

  // The call's bearer token checked against --auth_token_file.
  absl::Status Authorize(const grpc::CallbackServerContext& context) const;
  // Admits, finds the version (0: the newest ready one), decodes, checks
  // what the request will cost (server/scheduling/admission.h), enqueues and returns at
  // once; `reactor` is finished exactly once, on this thread when the call
  // is refused, else on the worker after `respond`. The request holds its
  // version until then, so a version replaced or unloaded meanwhile still
  // answers it. `api` labels mha_requests_total.
  void Dispatch(grpc::CallbackServerContext* context, CallReactor* reactor,
                const std::string& model_name, int64_t version, const char* api,
                const Decoder& decode, Responder respond);

  // How a call that is not a unary RPC of its own (a message of a stream)
  // is answered: `hold` keeps the request's memory reservation until its
  // answer is sent; `finish` answers, exactly once.
  struct Completion {
    std::function<void(std::shared_ptr<MemoryReservation>)> hold;
    std::function<void(const absl::Status&, absl::Duration took)> finish;
  };
  // Dispatch for such a call; `context` is its stream's.
  void Dispatch(grpc::CallbackServerContext* context, Completion completion,
                const std::string& model_name, int64_t version, const char* api,
                const Decoder& decode, Responder respond);

 private:
  const ModelRepository& models_;
  Metrics& metrics_;
  const RequestLimits limits_;
  const MemoryBudget& memory_;
  const BearerAuth auth_;
  std::atomic<bool> draining_{false};
};

// How a unary call is answered: its reactor holds the memory and finishes
// with the status and the server-time trailer.
AttendDispatcher::Completion UnaryCompletion(grpc::CallbackServerContext* context,
                                             CallReactor* reactor);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_ATTEND_DISPATCH_H_
