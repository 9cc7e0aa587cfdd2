// The thin gRPC layer: mha.v1.AttentionService on the callback API.
#ifndef MHA_SERVER_ATTENTION_SERVICE_H_
#define MHA_SERVER_ATTENTION_SERVICE_H_

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"
#include "server/attend_dispatch.h"

namespace mha::server {

// Borrows the dispatcher (which outlives the server). Handlers validate,
// enqueue and return; they never wait for compute. Thread-safe.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  explicit AttentionServiceImpl(AttendDispatcher& dispatcher) : dispatcher_(dispatcher) {}

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
  AttendDispatcher& dispatcher_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_SERVICE_H_
