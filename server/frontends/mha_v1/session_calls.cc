#include "server/frontends/mha_v1/session_calls.h"

#include <utility>

#include "absl/time/time.h"
#include "engine/status_macros.h"
#include "server/frontends/common/session_codec.h"

namespace mha::server {

void SessionCalls::Open(const grpc::CallbackServerContext& context,
                        const v1::OpenSessionRequest& request,
                        std::shared_ptr<const void> keep_alive, v1::Session* response, Done done) {
  auto decode = [&]() -> absl::StatusOr<OpenParams> {
    RETURN_IF_ERROR(gate_.Admit(AuthorizationOf(context)));
    ASSIGN_OR_RETURN(VersionPtr version,
                     gate_.models().Find(request.model(), request.model_version()));
    return DecodeOpenSession(request, std::move(version), gate_.limits());
  };
  absl::StatusOr<OpenParams> params = decode();
  if (!params.ok()) return done(params.status());
  if (params->memory.has_value() && keep_alive != nullptr) params->memory->KeepAlive(keep_alive);
  sessions_.Open(*std::move(params),
                 [response, done = std::move(done)](absl::StatusOr<SessionInfo> info) {
                   if (info.ok()) EncodeSession(*info, response);
                   done(info.status());
                 });
}

void SessionCalls::Append(const grpc::CallbackServerContext& context,
                          const v1::AppendRequest& request, std::shared_ptr<const void> keep_alive,
                          v1::AppendResponse* response, Done done) {
  Append(
      context, request, nullptr, std::move(keep_alive),
      [response](const StepLayout& layout, const StepResult& result) {
        EncodeAppendResult(layout, result, response);
        return absl::OkStatus();
      },
      std::move(done));
}

void SessionCalls::Append(const grpc::CallbackServerContext& context,
                          const v1::AppendRequest& request, const ReceivedBytes* query_data,
                          std::shared_ptr<const void> keep_alive, EncodeStep encode, Done done) {
  const absl::Time arrived = absl::Now();
  VersionPtr found;  // the session's version, once known
  auto decode = [&]() -> absl::StatusOr<StepParams> {
    RETURN_IF_ERROR(gate_.Authorize(AuthorizationOf(context)));
    ASSIGN_OR_RETURN(VersionPtr version, sessions_.VersionOf(request.session_id()));
    found = version;
    ASSIGN_OR_RETURN(StepParams params, DecodeAppend(request, version->loaded.engine->dims(),
                                                     gate_.limits(), query_data));
    params.decoded_for = std::move(version);
    // A step has no time limit of its own: its transport's.
    params.deadline =
        CallDeadline(absl::FromChrono(context.deadline()), arrived, absl::InfiniteDuration());
    params.cancelled = [&context] { return context.IsCancelled(); };
    return params;
  };
  absl::StatusOr<StepParams> params = decode();
  if (!params.ok()) {
    // A step refused before it is queued counts once, as a failure of
    // its session's version (an unknown session has none).
    if (found != nullptr) found->CountRefusal(arrived);
    return done(params.status());
  }
  if (keep_alive != nullptr) params->query.KeepAlive(std::move(keep_alive));
  const StepLayout layout = StepLayout::Of(*params);
  sessions_.Step(*std::move(params), [layout, encode = std::move(encode),
                                      done = std::move(done)](absl::StatusOr<StepResult> result) {
    done(result.ok() ? encode(layout, *result) : result.status());
  });
}

absl::Status SessionCalls::Fork(const grpc::CallbackServerContext& context,
                                const v1::ForkSessionRequest& request, v1::Session* response) {
  RETURN_IF_ERROR(gate_.Admit(AuthorizationOf(context)));
  if (!request.new_session_id().empty()) {
    RETURN_IF_ERROR(CheckSessionId(request.new_session_id(), "new_session_id"));
  }
  ASSIGN_OR_RETURN(SessionInfo fork,
                   sessions_.Fork(request.session_id(), request.new_session_id()));
  EncodeSession(fork, response);
  return absl::OkStatus();
}

absl::Status SessionCalls::Close(const grpc::CallbackServerContext& context,
                                 const v1::CloseSessionRequest& request,
                                 v1::CloseSessionResponse* response) {
  RETURN_IF_ERROR(gate_.Authorize(AuthorizationOf(context)));
  ASSIGN_OR_RETURN(SessionInfo closed, sessions_.Close(request.session_id()));
  response->set_freed_bytes(closed.own_bytes);
  response->set_position(closed.position);
  return absl::OkStatus();
}

absl::Status SessionCalls::List(const grpc::CallbackServerContext& context,
                                const v1::ListSessionsRequest& request,
                                v1::ListSessionsResponse* response) {
  RETURN_IF_ERROR(gate_.Authorize(AuthorizationOf(context)));
  for (const SessionInfo& info : sessions_.List(request.model())) {
    v1::SessionStatus* out = response->add_sessions();
    out->set_session_id(info.id);
    out->set_model(info.model);
    out->set_model_version(info.version);
    out->set_position(info.position);
    out->set_bytes(info.bytes);
    out->set_idle_ms(absl::ToInt64Milliseconds(info.idle));
    out->set_cross(info.cross);
    out->set_own_bytes(info.own_bytes);
    out->set_cache_dtype(info.cache_dtype);
  }
  return absl::OkStatus();
}

}  // namespace mha::server
