// inference.GRPCInferenceService (KServe v2 / Open Inference Protocol) on the
// same port as mha.v1: ModelInfer runs through the same front-end gate, batcher
// and engine as Attend.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_
#define MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_

#include <memory>

#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/common/kserve_calls.h"
#include "server/frontends/grpc/grpc_helpers.h"

namespace mha::server {

// The gRPC codec of KserveCalls (kserve_calls.h), which it borrows and
// which holds the protocol's logic: each RPC reads the caller's token from
// the metadata, calls it and finishes the reactor. Thread-safe.
// ModelInfer and ModelStreamInfer are read and written around their raw
// contents (proto/wire/): the service takes them as gRPC's bytes (the
// stream's handler is set in the constructor: a typed and a raw stream
// method cannot share a name in one class).
class KserveServiceImpl final
    : public inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
          inference::GRPCInferenceService::CallbackService> {
 public:
  explicit KserveServiceImpl(KserveCalls& calls);

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
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* LogSettings(grpc::CallbackServerContext* context,
                                        const inference::LogSettingsRequest* request,
                                        inference::LogSettingsResponse* response) override;
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
  KserveCalls& calls_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_SERVICE_H_
