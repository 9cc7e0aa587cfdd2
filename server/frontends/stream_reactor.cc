#include "server/frontends/stream_reactor.h"

#include <utility>

#include "server/frontends/attention_service.h"
#include "server/frontends/request_codec.h"

namespace mha::server {

void StreamReactor::Start(std::shared_ptr<v1::StreamRequest> request) {
  auto out = std::make_shared<Outbound>();
  out->response.set_id(request->id());
  auto done = [this, out](const absl::Status& status) { Answer(out, status); };
  switch (request->message_case()) {
    case v1::StreamRequest::kAttend: {
      AttendDispatcher::Completion completion;
      completion.hold = [out](std::shared_ptr<MemoryReservation> memory) {
        out->memory = std::move(memory);
      };
      completion.finish = [done](const absl::Status& status, absl::Duration) { done(status); };
      auto decode = [this, request](const ModelVersion& model) {
        absl::StatusOr<AttentionRequest> decoded =
            DecodeAttendRequest(request->attend(), model.model.dims, dispatcher_.limits());
        if (decoded.ok()) decoded->KeepAlive(request);  // its tensors view the message
        return decoded;
      };
      auto respond = [out](const ModelVersion& model, const ResultLayout& layout,
                           const AttentionResult& result) {
        EncodeAttendResponse(model, layout, result, out->response.mutable_attend());
      };
      dispatcher_.Dispatch(context_, std::move(completion), request->attend().model(),
                           request->attend().model_version(), kApiMha, decode,
                           std::move(respond));
      return;
    }
    case v1::StreamRequest::kOpenSession:
      return sessions_.Open(*context_, request->open_session(), request,
                            out->response.mutable_session(), done);
    case v1::StreamRequest::kAppend:
      return sessions_.Append(*context_, request->append(), request,
                              out->response.mutable_append(), done);
    case v1::StreamRequest::kCloseSession:
      return done(sessions_.Close(*context_, request->close_session(),
                                  out->response.mutable_close_session()));
    default:
      return done(absl::InvalidArgumentError(
          "stream message: set one of attend, open_session, append, close_session"));
  }
}

void StreamReactor::Answer(std::shared_ptr<Outbound> out, const absl::Status& status) {
  if (!status.ok()) {
    out->response.clear_message();
    out->response.set_code(static_cast<int>(status.code()));
    out->response.set_error_message(std::string(status.message()));
  }
  Reply(std::move(out));
}

}  // namespace mha::server
