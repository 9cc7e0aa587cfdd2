// KServe v2 (the Open Inference Protocol, with Triton's extensions) as calls
// of no transport: each takes the caller's Authorization value and the
// protocol's request message, and fills its response or says why not. The
// gRPC service (kserve_service.h) and the HTTP front end (http_routes.h) are
// codecs around these: nothing below the wire format differs between them.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_CALLS_H_
#define MHA_SERVER_FRONTENDS_KSERVE_CALLS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/common/kserve_codec.h"
#include "server/frontends/common/kserve_sequences.h"
#include "server/frontends/common/shared_memory.h"
#include "server/models/model_control.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

class KserveCalls;

// A ModelInfer request as a call: decoded and encoded the KServe way (the
// outputs it asks for, in their order); how its answer leaves (Send, Hold)
// is the transport's. `request` and `response` live until the answer is
// sent. Owned as every DispatchedCall.
class KserveInferCall : public DispatchedCall {
 public:
  KserveInferCall(const inference::ModelInferRequest& request,
                  inference::ModelInferResponse* response, const KserveCalls& calls);

  const inference::ModelInferRequest& request() const { return request_; }
  inference::ModelInferResponse* response() const { return response_; }
  // An unparsable version is refused by Decode, so that it is counted and
  // answered like every other refusal.
  int64_t version() const { return version_.value_or(0); }

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override;
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
  // Its deadline (CallDeadline) before it is decoded: a sequence's step
  // takes it so.
  absl::Time Deadline() const;

 protected:
  // For a transport that read the message around its raw contents
  // (proto/wire/): where they are; they must live as long as the call.
  void SetReceived(const RawReceived* received) { received_ = received; }
  // For a transport that writes the inline outputs itself, straight into
  // the message's bytes: EncodeResult lists them in `deferred` instead of
  // copying them into the response (FillInferResponse).
  void DeferOutputs(std::vector<DeferredOutput>* deferred) { deferred_ = deferred; }
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override;

 private:
  const inference::ModelInferRequest& request_;
  inference::ModelInferResponse* const response_;
  const FrontEndGate& gate_;
  const SharedMemoryRegistry& shared_memory_;
  const absl::StatusOr<int64_t> version_;
  const absl::StatusOr<InferCallParameters> call_parameters_;
  const absl::Time arrival_;
  std::vector<RequestedOutput> outputs_;  // as requested, known once decoded
  const RawReceived* received_ = nullptr;
  std::vector<DeferredOutput>* deferred_ = nullptr;
};

// Borrows the front-end gate, the model control and the session manager
// (which outlive it); owns Triton's system shared-memory registry and its
// sequences (on sessions), which every transport shares. Liveness and
// readiness need no token; everything else needs the bearer token when one
// is configured. Thread-safe.
class KserveCalls {
 public:
  using Done = std::function<void(const absl::Status&)>;

  KserveCalls(FrontEndGate& gate, ModelControl& control, SessionManager& sessions)
      : gate_(gate), control_(control), sequences_(gate, sessions, &shared_memory_) {}

  // Server health: live always, ready until the server drains.
  bool Ready() const { return !gate_.draining(); }
  absl::Status ServerMetadata(absl::string_view authorization,
                              inference::ServerMetadataResponse* response) const;
  // As Triton: a model (or version) that is unknown, unloaded or failed to
  // load is not ready, and that is an answer, not an error.
  absl::Status ModelReady(const inference::ModelReadyRequest& request,
                          inference::ModelReadyResponse* response) const;
  absl::Status ModelMetadata(absl::string_view authorization,
                             const inference::ModelMetadataRequest& request,
                             inference::ModelMetadataResponse* response) const;
  absl::Status ModelConfig(absl::string_view authorization,
                           const inference::ModelConfigRequest& request,
                           inference::ModelConfigResponse* response) const;
  absl::Status ModelStatistics(absl::string_view authorization,
                               const inference::ModelStatisticsRequest& request,
                               inference::ModelStatisticsResponse* response) const;
  // Triton's logging extension (log_settings.h).
  absl::Status LogSettings(absl::string_view authorization,
                           const inference::LogSettingsRequest& request,
                           inference::LogSettingsResponse* response) const;

  // ModelInfer's work for `call` (a unary call, a stream's message, an HTTP
  // request): a session step when it names a sequence, else an Attend
  // request through the gate. Answers the call once.
  void StartInfer(std::unique_ptr<KserveInferCall> call, const char* api);

  // Triton's repository extension (kserve_control.cc). Load and unload
  // answer through `done`, once (on the control thread, or at once when
  // refused); the request lives until then.
  absl::Status RepositoryIndex(absl::string_view authorization,
                               const inference::RepositoryIndexRequest& request,
                               inference::RepositoryIndexResponse* response) const;
  void RepositoryModelLoad(absl::string_view authorization,
                           const inference::RepositoryModelLoadRequest& request, Done done);
  void RepositoryModelUnload(absl::string_view authorization,
                             const inference::RepositoryModelUnloadRequest& request, Done done);

  // Triton's system shared memory, and CUDA's (refused: no GPU here).
  absl::Status SystemSharedMemoryStatus(
      absl::string_view authorization, const inference::SystemSharedMemoryStatusRequest& request,
      inference::SystemSharedMemoryStatusResponse* response) const;
  absl::Status SystemSharedMemoryRegister(
      absl::string_view authorization, const inference::SystemSharedMemoryRegisterRequest& request);
  absl::Status SystemSharedMemoryUnregister(
      absl::string_view authorization,
      const inference::SystemSharedMemoryUnregisterRequest& request);
  absl::Status CudaSharedMemoryStatus(
      absl::string_view authorization,
      const inference::CudaSharedMemoryStatusRequest& request) const;
  absl::Status CudaSharedMemoryRegister(absl::string_view authorization) const;
  absl::Status CudaSharedMemoryUnregister(absl::string_view authorization) const;

  const FrontEndGate& gate() const { return gate_; }

 private:
  friend class KserveInferCall;
  // Auth, then model control on (not mode none), the repository name
  // empty or ours.
  absl::Status RepositoryCallAllowed(absl::string_view authorization,
                                     const std::string& repository_name) const;
  // The version named ("": the newest ready one), or why not.
  absl::StatusOr<VersionPtr> FindVersion(const std::string& name, const std::string& version) const;

  FrontEndGate& gate_;
  ModelControl& control_;
  SharedMemoryRegistry shared_memory_;  // Triton's system shared memory
  SequenceCalls sequences_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_CALLS_H_
