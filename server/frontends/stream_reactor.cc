#include "server/frontends/stream_reactor.h"

#include <memory>
#include <utility>

#include "server/frontends/attention_service.h"
#include "server/frontends/request_codec.h"

namespace mha::server {

// An attend message: decoded from the stream's message (which its tensors
// view, so the request keeps it alive), answered on the stream.
class StreamReactor::AttendMessage final : public DispatchedCall {
 public:
  AttendMessage(StreamReactor& stream, std::shared_ptr<v1::StreamRequest> request,
                std::shared_ptr<Outbound> out)
      : stream_(stream), request_(std::move(request)), out_(std::move(out)) {}

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override {
    absl::StatusOr<AttentionRequest> decoded =
        DecodeAttendRequest(request_->attend(), model.loaded.dims, stream_.gate_.limits());
    if (decoded.ok()) decoded->KeepAlive(request_);
    return decoded;
  }

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    EncodeAttendResponse(model, layout, result, out_->response.mutable_attend());
    return absl::OkStatus();
  }
  void Send(const absl::Status& status, absl::Duration) override { stream_.Answer(out_, status); }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    out_->memory = std::move(memory);
  }

  StreamReactor& stream_;
  const std::shared_ptr<v1::StreamRequest> request_;
  const std::shared_ptr<Outbound> out_;
};

void StreamReactor::Start(std::shared_ptr<v1::StreamRequest> request) {
  auto out = std::make_shared<Outbound>();
  out->response.set_id(request->id());
  auto done = [this, out](const absl::Status& status) { Answer(out, status); };
  switch (request->message_case()) {
    case v1::StreamRequest::kAttend:
      return gate_.Dispatch(context_, std::make_unique<AttendMessage>(*this, request, out),
                            request->attend().model(), request->attend().model_version(), kApiMha);
    case v1::StreamRequest::kOpenSession:
      return sessions_.Open(*context_, request->open_session(), request,
                            out->response.mutable_session(), done);
    case v1::StreamRequest::kAppend:
      return sessions_.Append(*context_, request->append(), request, out->response.mutable_append(),
                              done);
    case v1::StreamRequest::kForkSession:
      return done(
          sessions_.Fork(*context_, request->fork_session(), out->response.mutable_session()));
    case v1::StreamRequest::kCloseSession:
      return done(sessions_.Close(*context_, request->close_session(),
                                  out->response.mutable_close_session()));
    default:
      return done(absl::InvalidArgumentError(
          "stream message: set one of attend, open_session, append, close_session, "
          "fork_session"));
  }
}

void StreamReactor::Answer(std::shared_ptr<Outbound> out, const absl::Status& status) {
  if (!status.ok()) {
    out->response.clear_message();
    out->response.set_code(static_cast<int>(status.code()));
    out->response.set_error_message(MessageOf(status));
  }
  Reply(std::move(out));
}

}  // namespace mha::server
