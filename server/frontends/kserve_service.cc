#include "server/frontends/kserve_service.h"

#include <memory>
#include <utility>

#include "server/frontends/message_stream.h"

namespace mha::server {

grpc::ServerUnaryReactor* KserveServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerReady(grpc::CallbackServerContext* context,
                                                         const inference::ServerReadyRequest*,
                                                         inference::ServerReadyResponse* response) {
  response->set_ready(calls_.Ready());  // as grpc.health.v1's overall status
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  return FinishUnary(context, calls_.ModelReady(*request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  return FinishUnary(context, calls_.ServerMetadata(AuthorizationOf(*context), response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  return FinishUnary(context, calls_.ModelMetadata(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  return FinishUnary(context, calls_.ModelConfig(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const inference::ModelInferRequest* request,
                                                        inference::ModelInferResponse* response) {
  auto* reactor = new CallReactor();
  calls_.StartInfer(
      context,
      std::make_unique<UnaryCall<KserveInferCall>>(context, reactor, *request, response, calls_),
      kApiKserve);
  return reactor;
}

// One ModelStreamInfer call: each request runs as ModelInfer does; an error
// is its answer's error_message (with the request's id and model name).
class KserveServiceImpl::InferStream final
    : public MessageStream<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
 public:
  InferStream(grpc::CallbackServerContext* context, KserveCalls& calls)
      : context_(context), calls_(calls) {
    StartReading();
  }

 private:
  // A request of the stream; it keeps its message alive until answered.
  class Message final : public KserveInferCall {
   public:
    Message(InferStream& stream, std::shared_ptr<inference::ModelInferRequest> request,
            std::shared_ptr<Outbound> out)
        : KserveInferCall(*request, out->response.mutable_infer_response(), stream.calls_),
          stream_(stream),
          message_(std::move(request)),
          out_(std::move(out)) {}

   private:
    void Send(const absl::Status& status, absl::Duration) override {
      inference::ModelInferResponse* infer = out_->response.mutable_infer_response();
      if (!status.ok()) {
        out_->response.set_error_message(MessageOf(status));
        infer->Clear();
        infer->set_id(message_->id());
        infer->set_model_name(message_->model_name());
        infer->set_model_version(message_->model_version());
      }
      if (final_response_flag()) {  // one response per request: the last
        (*infer->mutable_parameters())["triton_final_response"].set_bool_param(true);
      }
      stream_.Reply(out_);
    }
    void Hold(std::shared_ptr<MemoryReservation> memory) override {
      out_->memory = std::move(memory);
    }

    InferStream& stream_;
    const std::shared_ptr<inference::ModelInferRequest> message_;
    const std::shared_ptr<Outbound> out_;
  };

  void Start(std::shared_ptr<inference::ModelInferRequest> request) override {
    auto out = std::make_shared<Outbound>();
    calls_.StartInfer(context_, std::make_unique<Message>(*this, std::move(request), out),
                      kApiKserve);
  }

  grpc::CallbackServerContext* const context_;
  KserveCalls& calls_;
};

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
KserveServiceImpl::ModelStreamInfer(grpc::CallbackServerContext* context) {
  return new InferStream(context, calls_);
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  return FinishUnary(context,
                     calls_.ModelStatistics(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  return FinishUnary(context,
                     calls_.RepositoryIndex(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  calls_.RepositoryModelLoad(AuthorizationOf(*context), *request, FinisherOf(reactor));
  return reactor;
}

grpc::ServerUnaryReactor* KserveServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  calls_.RepositoryModelUnload(AuthorizationOf(*context), *request, FinisherOf(reactor));
  return reactor;
}

grpc::ServerUnaryReactor* KserveServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  return FinishUnary(
      context, calls_.SystemSharedMemoryStatus(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse*) {
  return FinishUnary(context,
                     calls_.SystemSharedMemoryRegister(AuthorizationOf(*context), *request));
}

grpc::ServerUnaryReactor* KserveServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse*) {
  return FinishUnary(context,
                     calls_.SystemSharedMemoryUnregister(AuthorizationOf(*context), *request));
}

grpc::ServerUnaryReactor* KserveServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
    inference::CudaSharedMemoryStatusResponse*) {
  return FinishUnary(context, calls_.CudaSharedMemoryStatus(AuthorizationOf(*context), *request));
}

grpc::ServerUnaryReactor* KserveServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryRegisterRequest*,
    inference::CudaSharedMemoryRegisterResponse*) {
  return FinishUnary(context, calls_.CudaSharedMemoryRegister(AuthorizationOf(*context)));
}

grpc::ServerUnaryReactor* KserveServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryUnregisterRequest*,
    inference::CudaSharedMemoryUnregisterResponse*) {
  return FinishUnary(context, calls_.CudaSharedMemoryUnregister(AuthorizationOf(*context)));
}

}  // namespace mha::server
