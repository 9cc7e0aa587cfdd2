#include "server/frontends/kserve_grpc/kserve_service.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "engine/status_macros.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "server/frontends/grpc/message_stream.h"
#include "server/frontends/grpc/wire_responses.h"
#include "wire/wire_reader.h"
#include "wire/wire_writer.h"

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

namespace {

// A ModelInfer request read around its raw contents (proto/wire/), with
// where each entry is, and the response message it is answered with before
// its bytes are written.
struct ReceivedInfer : wire::ReceivedMessage<inference::ModelInferRequest> {
  RawReceived raw;
  inference::ModelInferResponse response;

  absl::Status Read(const grpc::ByteBuffer& buffer) {
    RETURN_IF_ERROR(
        ReceivedMessage::Read(buffer, wire::kInferRequestPayloads, "ModelInferRequest"));
    raw.assign(fields.raw_input_contents_size(), nullptr);
    size_t index = 0;  // the payloads come in the order of their entries
    for (const wire::WirePayload& payload : read.payloads) raw[index++] = &payload.pieces;
    return absl::OkStatus();
  }
  // The raw contents copied into the message, for a path that reads the
  // message itself (a sequence's step: a few tokens). Entries parsed whole
  // (null) are in the message already.
  void Materialize() {
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == nullptr) continue;
      wire::AppendPieces(*raw[i], *fields.mutable_raw_input_contents(static_cast<int>(i)));
      raw[i] = nullptr;
    }
  }
};

// A ModelInfer request answered as gRPC's bytes: the inline outputs are
// written straight from the engine's output into the message's bytes, once
// (the rest of the response through protobuf); `field` > 0 nests the
// response in that field of the message written (a stream's answer). Owns
// the received request; a transport's Send and Hold answer it.
class ReceivedInferCall : public KserveInferCall {
 protected:
  ReceivedInferCall(std::unique_ptr<ReceivedInfer> received, const KserveCalls& calls, int field)
      : KserveInferCall(received->fields, &received->response, calls),
        received_(std::move(received)),
        field_(field) {
    if (sequence_parameters() != nullptr) {  // its step reads the message
      received_->Materialize();
    } else {
      SetReceived(&received_->raw);
    }
    DeferOutputs(&deferred_);
  }

  // The written answer; empty until EncodeResult (a sequence's step and an
  // error are answered through protobuf).
  grpc::ByteBuffer& written() { return written_; }
  bool was_written() const { return was_written_; }
  const ReceivedInfer& received() const { return *received_; }
  bool SendsConvertedOutput() const override { return true; }  // WriteInferResponse
  // Marks `response` as its request's last when the request asks to be told.
  void MarkFinal(inference::ModelInferResponse& response) const {
    if (final_response_flag()) {
      (*response.mutable_parameters())["triton_final_response"].set_bool_param(true);
    }
  }

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) final {
    deferred_.clear();
    RETURN_IF_ERROR(KserveInferCall::EncodeResult(model, layout, result));
    if (field_ > 0) MarkFinal(received_->response);
    wire::WireWriter infer;
    WriteInferResponse(received_->response, deferred_, infer);
    if (field_ > 0) {
      wire::WireWriter outer;
      outer.AppendMessage(field_, infer);
      written_ = outer.Finish();
    } else {
      written_ = infer.Finish();
    }
    was_written_ = true;
    return absl::OkStatus();
  }

  const std::unique_ptr<ReceivedInfer> received_;
  const int field_;
  std::vector<DeferredOutput> deferred_;
  grpc::ByteBuffer written_;
  bool was_written_ = false;
};

// A unary ModelInfer: holds the memory until the response is sent, as
// UnaryCall does.
class RawInferCall final : public OverGrpc<ReceivedInferCall> {
 public:
  RawInferCall(grpc::CallbackServerContext* context, CallReactor* reactor,
               std::unique_ptr<ReceivedInfer> received, grpc::ByteBuffer* bytes,
               const KserveCalls& calls)
      : OverGrpc<ReceivedInferCall>(context, std::move(received), calls, 0),
        reactor_(reactor),
        bytes_(bytes) {}

 private:
  void Send(const absl::Status& status, absl::Duration took) override {
    if (status.ok()) {  // a sequence's step answers the message as it is
      *bytes_ = was_written() ? written() : MessageBytes(received().response);
    }
    SendUnary(context_, reactor_, status, took, compute_time);
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    reactor_->Hold(std::move(memory));
  }

  CallReactor* const reactor_;
  grpc::ByteBuffer* const bytes_;
};

}  // namespace

grpc::ServerUnaryReactor* KserveServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  auto received = std::make_unique<ReceivedInfer>();
  if (absl::Status read = received->Read(*request); !read.ok()) {
    return FinishUnary(context, read);
  }
  auto* reactor = new CallReactor();
  calls_.StartInfer(
      std::make_unique<RawInferCall>(context, reactor, std::move(received), response, calls_),
      kApiKserve);
  return reactor;
}

namespace {

// One ModelStreamInfer call: each request runs as ModelInfer does (read
// and written around its raw contents); an error is its answer's
// error_message (with the request's id and model name), a message that
// does not parse included.
class InferStream final : public MessageStream<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  InferStream(grpc::CallbackServerContext* context, KserveCalls& calls)
      : context_(context), calls_(calls) {
    StartReading();
  }

 private:
  // A request of the stream, answered in ModelStreamInferResponse's
  // infer_response (field 2); it keeps its received bytes alive until
  // answered.
  class Message final : public OverGrpc<ReceivedInferCall> {
   public:
    Message(InferStream& stream, std::unique_ptr<ReceivedInfer> received,
            std::shared_ptr<Outbound> out)
        : OverGrpc<ReceivedInferCall>(stream.context_, std::move(received), stream.calls_, 2),
          stream_(stream),
          out_(std::move(out)) {}

   private:
    void Send(const absl::Status& status, absl::Duration) override {
      if (status.ok() && was_written()) {
        out_->response = written();
      } else {  // an error, or a sequence's step: through protobuf
        inference::ModelStreamInferResponse message;
        inference::ModelInferResponse* infer = message.mutable_infer_response();
        if (status.ok()) {
          *infer = received().response;
        } else {
          message.set_error_message(MessageOf(status));
          infer->set_id(received().fields.id());
          infer->set_model_name(received().fields.model_name());
          infer->set_model_version(received().fields.model_version());
        }
        MarkFinal(*infer);
        out_->response = MessageBytes(message);
      }
      stream_.Reply(out_);
    }
    void Hold(std::shared_ptr<MemoryReservation> memory) override {
      out_->memory = std::move(memory);
    }

    InferStream& stream_;
    const std::shared_ptr<Outbound> out_;
  };

  void Start(std::shared_ptr<grpc::ByteBuffer> bytes) override {
    auto out = std::make_shared<Outbound>();
    auto received = std::make_unique<ReceivedInfer>();
    if (absl::Status read = received->Read(*bytes); !read.ok()) {
      inference::ModelStreamInferResponse message;
      message.set_error_message(MessageOf(read));
      out->response = MessageBytes(message);
      return Reply(std::move(out));
    }
    calls_.StartInfer(std::make_unique<Message>(*this, std::move(received), out), kApiKserve);
  }

  grpc::CallbackServerContext* const context_;
  KserveCalls& calls_;
};

}  // namespace

KserveServiceImpl::KserveServiceImpl(KserveCalls& calls) : calls_(calls) {
  MarkMethodRawCallback(MethodIndex(*inference::ModelInferRequest::descriptor()->file(),
                                    "GRPCInferenceService", "ModelStreamInfer"),
                        new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                            [this](grpc::CallbackServerContext* context) {
                              return new InferStream(context, calls_);
                            }));
}

grpc::ServerUnaryReactor* KserveServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  return FinishUnary(context,
                     calls_.ModelStatistics(AuthorizationOf(*context), *request, response));
}

grpc::ServerUnaryReactor* KserveServiceImpl::LogSettings(
    grpc::CallbackServerContext* context, const inference::LogSettingsRequest* request,
    inference::LogSettingsResponse* response) {
  return FinishUnary(context, calls_.LogSettings(AuthorizationOf(*context), *request, response));
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
