// The thin gRPC layer: mha.v1.AttentionService on the callback API.
#ifndef MHA_SERVER_FRONTENDS_ATTENTION_SERVICE_H_
#define MHA_SERVER_FRONTENDS_ATTENTION_SERVICE_H_

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/grpc/grpc_helpers.h"
#include "server/frontends/mha_v1/session_calls.h"
#include "server/models/model_control.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// Borrows the front-end gate, the model control and the sessions (all outlive
// the server).
// Handlers validate, enqueue and return; they never wait for compute or for
// a load. Thread-safe.
// Attend, Append and Stream are read and written around their tensor bytes
// (proto/wire/): the service takes them as gRPC's bytes (Stream's handler is
// set in the constructor: a typed and a raw stream method cannot share a
// name in one class).
class AttentionServiceImpl final : public v1::AttentionService::WithRawCallbackMethod_Attend<
                                       v1::AttentionService::WithRawCallbackMethod_Append<
                                           v1::AttentionService::CallbackService>> {
 public:
  AttentionServiceImpl(FrontEndGate& gate, ModelControl& control, SessionManager& sessions);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context,
                                      const v1::LoadModelRequest* request,
                                      v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* UnloadModel(grpc::CallbackServerContext* context,
                                        const v1::UnloadModelRequest* request,
                                        v1::UnloadModelResponse* response) override;
  grpc::ServerUnaryReactor* GetModelStatistics(grpc::CallbackServerContext* context,
                                               const v1::GetModelStatisticsRequest* request,
                                               v1::ModelStatisticsResponse* response) override;
  // Sessions (server/frontends/mha_v1/session_service.cc).
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::Session* response) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::Session* response) override;
  grpc::ServerWriteReactor<v1::SessionChunk>* ExportSession(
      grpc::CallbackServerContext* context, const v1::ExportSessionRequest* request) override;
  grpc::ServerReadReactor<v1::SessionChunk>* ImportSession(grpc::CallbackServerContext* context,
                                                           v1::Session* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;

 private:
  // Why a model control call may not run (auth, mode none), or OK.
  absl::Status ControlAllowed(const grpc::CallbackServerContext& context) const;

  FrontEndGate& gate_;
  ModelControl& control_;
  SessionManager& sessions_;
  SessionCalls session_calls_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_ATTENTION_SERVICE_H_
