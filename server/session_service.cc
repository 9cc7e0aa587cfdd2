// AttentionServiceImpl's session RPCs: authorize, decode, hand to the
// session manager, encode.
#include <utility>

#include "engine/status_macros.h"
#include "server/attention_service.h"
#include "server/session_codec.h"

namespace mha::server {

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(
    grpc::CallbackServerContext* context, const v1::OpenSessionRequest* request,
    v1::Session* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto decode = [&]() -> absl::StatusOr<OpenParams> {
    RETURN_IF_ERROR(dispatcher_.Authorize(*context));
    ASSIGN_OR_RETURN(VersionPtr version,
                     dispatcher_.models().Find(request->model(), request->model_version()));
    return DecodeOpenSession(*request, std::move(version), dispatcher_.limits());
  };
  absl::StatusOr<OpenParams> params = decode();
  if (!params.ok()) {
    reactor->Finish(ToGrpcStatus(params.status()));
    return reactor;
  }
  sessions_.Open(*std::move(params), [reactor, response](absl::StatusOr<SessionInfo> info) {
    if (info.ok()) EncodeSession(*info, response);
    reactor->Finish(ToGrpcStatus(info.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Append(grpc::CallbackServerContext* context,
                                                       const v1::AppendRequest* request,
                                                       v1::AppendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto decode = [&]() -> absl::StatusOr<AppendParams> {
    RETURN_IF_ERROR(dispatcher_.Authorize(*context));
    ASSIGN_OR_RETURN(VersionPtr version, sessions_.VersionOf(request->session_id()));
    return DecodeAppend(*request, version->model.engine->dims(), dispatcher_.limits());
  };
  absl::StatusOr<AppendParams> params = decode();
  if (!params.ok()) {
    reactor->Finish(ToGrpcStatus(params.status()));
    return reactor;
  }
  const StepLayout layout = StepLayout::Of(*params);
  sessions_.Append(*std::move(params),
                   [reactor, response, layout](absl::StatusOr<AppendResult> result) {
                     if (result.ok()) EncodeAppendResult(layout, *result, response);
                     reactor->Finish(ToGrpcStatus(result.status()));
                   });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(
    grpc::CallbackServerContext* context, const v1::CloseSessionRequest* request,
    v1::CloseSessionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = dispatcher_.Authorize(*context);
  if (status.ok()) {
    absl::StatusOr<SessionInfo> closed = sessions_.Close(request->session_id());
    status = closed.status();
    if (closed.ok()) {
      response->set_freed_bytes(closed->bytes);
      response->set_position(closed->position);
    }
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSessions(
    grpc::CallbackServerContext* context, const v1::ListSessionsRequest* request,
    v1::ListSessionsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status status = dispatcher_.Authorize(*context);
  if (status.ok()) {
    for (const SessionInfo& info : sessions_.List(request->model())) {
      v1::SessionStatus* out = response->add_sessions();
      out->set_session_id(info.id);
      out->set_model(info.model);
      out->set_model_version(info.version);
      out->set_position(info.position);
      out->set_bytes(info.bytes);
      out->set_idle_ms(absl::ToInt64Milliseconds(info.idle));
      out->set_cross(info.cross);
    }
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace mha::server
