// The thin gRPC layer: mha.v1.AttentionService on the callback API.
#ifndef MHA_SERVER_ATTENTION_SERVICE_H_
#define MHA_SERVER_ATTENTION_SERVICE_H_

#include <atomic>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/request_codec.h"

namespace mha::server {

// Trailing metadata of every Attend answer: microseconds from handler in to
// response out.
inline constexpr char kServerTimeMetadata[] = "mha-server-time-us";

// The one conversion from absl::Status to grpc::Status.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Borrows the repository and the metrics (both outlive the server).
// Handlers validate, enqueue and return; they never wait for compute.
// Thread-safe.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(const ModelRepository& models, Metrics& metrics, RequestLimits limits,
                       BearerAuth auth = {})
      : models_(models), metrics_(metrics), limits_(limits), auth_(std::move(auth)) {}

  // After this, new Attend calls get UNAVAILABLE.
  void StartDraining() { draining_ = true; }

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;

 private:
  // The call's bearer token checked against --auth_token_file.
  absl::Status Authorize(const grpc::CallbackServerContext& context) const;
  // Finds a serving model or says why not (NOT_FOUND, FAILED_PRECONDITION).
  absl::StatusOr<const ServedModel*> ServingModel(const std::string& name) const;

  const ModelRepository& models_;
  Metrics& metrics_;
  const RequestLimits limits_;
  const BearerAuth auth_;
  std::atomic<bool> draining_{false};
};

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_SERVICE_H_
