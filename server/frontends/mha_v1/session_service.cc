// AttentionServiceImpl's session RPCs: each a thin wrapper of SessionCalls.
#include <string>

#include "absl/time/clock.h"
#include "server/frontends/grpc/wire_responses.h"
#include "server/frontends/mha_v1/attention_service.h"
#include "server/frontends/mha_v1/session_transfer.h"
#include "wire/wire_reader.h"

namespace mha::server {

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* context,
                                                            const v1::OpenSessionRequest* request,
                                                            v1::Session* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  session_calls_.Open(*context, *request, nullptr, response, FinisherOf(reactor));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Append(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  // Read around the query's bytes (proto/wire/), which the step keeps
  // alive; answered with the output written once into gRPC's buffer.
  auto received = std::make_shared<wire::ReceivedMessage<v1::AppendRequest>>();
  if (absl::Status read = received->Read(*request, wire::kAppendRequestPayloads, "AppendRequest");
      !read.ok()) {
    return FinishUnary(context, read);
  }
  static constexpr int kQueryData[] = {2, 3};
  const ReceivedBytes* query = received->Payload(kQueryData);
  const v1::AppendRequest& fields = received->fields;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  session_calls_.Append(
      *context, fields, query, std::move(received),
      [response](const StepLayout& layout, const StepResult& result) {
        *response = AppendResponseBytes(layout, result);
        return absl::OkStatus();
      },
      FinisherOf(reactor));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ForkSession(grpc::CallbackServerContext* context,
                                                            const v1::ForkSessionRequest* request,
                                                            v1::Session* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status status = session_calls_.Fork(*context, *request, response);
  context->AddTrailingMetadata(std::string(kServerTimeMetadata),
                               std::to_string(absl::ToInt64Microseconds(absl::Now() - start)));
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerWriteReactor<v1::SessionChunk>* AttentionServiceImpl::ExportSession(
    grpc::CallbackServerContext* context, const v1::ExportSessionRequest* request) {
  return StartExportSession(context, *request, gate_, sessions_);
}

grpc::ServerReadReactor<v1::SessionChunk>* AttentionServiceImpl::ImportSession(
    grpc::CallbackServerContext* context, v1::Session* response) {
  return StartImportSession(context, response, gate_, sessions_);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* context,
                                                             const v1::CloseSessionRequest* request,
                                                             v1::CloseSessionResponse* response) {
  return FinishUnary(context, session_calls_.Close(*context, *request, response));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSessions(grpc::CallbackServerContext* context,
                                                             const v1::ListSessionsRequest* request,
                                                             v1::ListSessionsResponse* response) {
  return FinishUnary(context, session_calls_.List(*context, *request, response));
}

}  // namespace mha::server
