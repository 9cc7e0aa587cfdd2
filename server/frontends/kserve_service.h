// inference.GRPCInferenceService (KServe v2 / Open Inference Protocol) on the
// same port as mha.v1: ModelInfer runs through the same front-end gate, batcher
// and engine as Attend.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_
#define MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_

#include <memory>

#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/front_end_gate.h"
#include "server/frontends/kserve_sequences.h"
#include "server/frontends/shared_memory.h"
#include "server/models/model_control.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// Borrows the front-end gate, the model control and the session manager (which
// outlive the server); requests with Triton's sequence_id are session steps
// (kserve_sequences.h). Liveness and readiness
// RPCs stay open like grpc.health.v1; metadata and inference need the bearer
// token when one is configured. Thread-safe.
class KserveServiceImpl final : public inference::GRPCInferenceService::CallbackService {
 public:
  KserveServiceImpl(FrontEndGate& gate, ModelControl& control, SessionManager& sessions)
      : gate_(gate), control_(control), sequences_(gate, sessions, &shared_memory_) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override;
  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
  ModelStreamInfer(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
      inference::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryRegisterRequest* request,
      inference::CudaSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryUnregisterRequest* request,
      inference::CudaSharedMemoryUnregisterResponse* response) override;

 private:
  class InferCall;
  class InferStream;
  // ModelInfer's work for `call` (a unary call, or a stream's message): a
  // session step when it names a sequence, else an Attend request.
  void StartInfer(grpc::CallbackServerContext* context, std::unique_ptr<InferCall> call);
  // Auth, then model control on (not mode none), the repository name
  // empty or ours.
  absl::Status RepositoryCallAllowed(const grpc::CallbackServerContext& context,
                                     const std::string& repository_name) const;
  // The version named ("": the newest ready one), or why not.
  absl::StatusOr<VersionPtr> FindVersion(const std::string& name, const std::string& version) const;

  FrontEndGate& gate_;
  ModelControl& control_;
  SharedMemoryRegistry shared_memory_;  // Triton's system shared memory
  SequenceCalls sequences_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_
