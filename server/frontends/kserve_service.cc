#include "server/frontends/kserve_service.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "engine/status_macros.h"
#include "server/frontends/message_stream.h"
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
  // message itself (a sequence's step: a few tokens).
  void Materialize() {
    for (size_t i = 0; i < raw.size(); ++i) {
      std::string* entry = fields.mutable_raw_input_contents(static_cast<int>(i));
      for (absl::Span<const uint8_t> piece : *raw[i]) {
        entry->append(reinterpret_cast<const char*>(piece.data()), piece.size());
      }
    }
    raw.assign(raw.size(), nullptr);
  }
};

// A unary ModelInfer answered as gRPC's bytes: the inline outputs are
// written straight from the engine's output into the message's bytes, once
// (the rest of the response through protobuf). Holds the memory until the
// response is sent, as UnaryCall does.
class RawInferCall final : public KserveInferCall {
 public:
  RawInferCall(grpc::CallbackServerContext* context, CallReactor* reactor,
               std::unique_ptr<ReceivedInfer> received, grpc::ByteBuffer* bytes,
               const KserveCalls& calls)
      : KserveInferCall(received->fields, &received->response, calls),
        context_(context),
        reactor_(reactor),
        received_(std::move(received)),
        bytes_(bytes) {
    if (sequence_parameters() != nullptr) {
      received_->Materialize();
    } else {
      SetReceived(&received_->raw);
    }
    DeferOutputs(&deferred_);
  }

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    deferred_.clear();
    RETURN_IF_ERROR(KserveInferCall::EncodeResult(model, layout, result));
    inference::ModelInferResponse fields = received_->response;
    fields.clear_raw_output_contents();
    wire::WireWriter writer;
    writer.Append(fields);
    size_t next = 0;
    for (int i = 0; i < received_->response.raw_output_contents_size(); ++i) {
      if (next < deferred_.size() && deferred_[next].raw_index == i) {
        const DeferredOutput& out = deferred_[next++];
        writer.AppendBytes(6, out.values.size() * DTypeSize(out.dtype),
                           [&](uint8_t* to) { WriteBytes(out.values, out.dtype, to); });
      } else {  // written to shared memory: an empty entry
        const std::string& raw = received_->response.raw_output_contents(i);
        writer.AppendBytes(6, raw.size(),
                           [&](uint8_t* to) { std::memcpy(to, raw.data(), raw.size()); });
      }
    }
    *bytes_ = writer.Finish();
    written_ = true;
    return absl::OkStatus();
  }
  void Send(const absl::Status& status, absl::Duration took) override {
    if (status.ok() && !written_) {  // answered by a sequence's step: the message as it is
      const std::string serialized = received_->response.SerializeAsString();
      grpc::Slice slice(serialized);
      *bytes_ = grpc::ByteBuffer(&slice, 1);
    }
    SendUnary(context_, reactor_, status, took, compute_time);
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    reactor_->Hold(std::move(memory));
  }

  grpc::CallbackServerContext* const context_;
  CallReactor* const reactor_;
  const std::unique_ptr<ReceivedInfer> received_;
  grpc::ByteBuffer* const bytes_;
  std::vector<DeferredOutput> deferred_;
  bool written_ = false;
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
      context,
      std::make_unique<RawInferCall>(context, reactor, std::move(received), response, calls_),
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
