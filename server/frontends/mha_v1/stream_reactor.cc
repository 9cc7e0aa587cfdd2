#include "server/frontends/mha_v1/stream_reactor.h"

#include <memory>
#include <utility>

#include "server/frontends/common/request_codec.h"
#include "server/frontends/grpc/wire_responses.h"
#include "wire/wire_reader.h"
#include "wire/wire_writer.h"

namespace mha::server {

using ReceivedStreamRequest = wire::ReceivedMessage<v1::StreamRequest>;

// A message's answer: its small fields (id, code, a session's answer), and
// its bytes once written (an Attend's or Append's answer is written around
// its tensors as soon as they are computed).
struct StreamReactor::Pending {
  v1::StreamResponse message;
  std::shared_ptr<Outbound> out = std::make_shared<Outbound>();
  bool written = false;

  // The answer with `field` (a message) written by `write`.
  template <typename Write>
  void WriteWith(int field, Write write) {
    wire::WireWriter inner;
    write(inner);
    wire::WireWriter writer;
    v1::StreamResponse id;
    id.set_id(message.id());
    writer.Append(id);
    writer.AppendMessage(field, inner);
    out->response = writer.Finish();
    written = true;
  }
};

// An attend message: decoded from the stream's message (which its tensors
// view, so the request keeps it alive), answered on the stream.
class StreamReactor::AttendMessage final : public OverGrpc<DispatchedCall> {
 public:
  AttendMessage(StreamReactor& stream, std::shared_ptr<const ReceivedStreamRequest> request,
                std::shared_ptr<Pending> pending)
      : OverGrpc<DispatchedCall>(stream.context_),
        stream_(stream),
        request_(std::move(request)),
        pending_(std::move(pending)) {}

  absl::StatusOr<AttentionRequest> Decode(const ModelVersion& model) override {
    AttendReceived data{};
    for (int i = 0; i < 5; ++i) {
      const int path[] = {2, i + 2, 3};  // StreamRequest.attend's tensors' data
      data[i] = request_->Payload(path);
    }
    absl::StatusOr<AttentionRequest> decoded = DecodeAttendRequest(
        request_->fields.attend(), model.loaded.dims, stream_.gate_.limits(), data);
    if (decoded.ok()) decoded->KeepAlive(request_);
    return decoded;
  }

  bool SendsConvertedOutput() const override { return true; }  // WriteAttendResponse

 private:
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    pending_->WriteWith(4, [&](wire::WireWriter& inner) {  // StreamResponse.attend
      WriteAttendResponse(model.name, model.version, layout, result, inner);
    });
    return absl::OkStatus();
  }
  void Send(const absl::Status& status, absl::Duration) override {
    stream_.Answer(pending_, status);
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override {
    pending_->out->memory = std::move(memory);
  }

  StreamReactor& stream_;
  const std::shared_ptr<const ReceivedStreamRequest> request_;
  const std::shared_ptr<Pending> pending_;
};

void StreamReactor::Start(std::shared_ptr<grpc::ByteBuffer> bytes) {
  auto pending = std::make_shared<Pending>();
  auto received = std::make_shared<ReceivedStreamRequest>();
  if (absl::Status read = received->Read(*bytes, wire::kStreamRequestPayloads, "StreamRequest");
      !read.ok()) {
    return Answer(pending, read);
  }
  const v1::StreamRequest& request = received->fields;
  pending->message.set_id(request.id());
  auto done = [this, pending](const absl::Status& status) { Answer(pending, status); };
  switch (request.message_case()) {
    case v1::StreamRequest::kAttend:
      return gate_.Dispatch(std::make_unique<AttendMessage>(*this, received, pending),
                            request.attend().model(), request.attend().model_version(), kApiMha);
    case v1::StreamRequest::kOpenSession:
      return sessions_.Open(*context_, request.open_session(), received,
                            pending->message.mutable_session(), done);
    case v1::StreamRequest::kAppend: {
      static constexpr int kQueryData[] = {4, 2, 3};  // StreamRequest.append's query's data
      const ReceivedBytes* query = received->Payload(kQueryData);
      return sessions_.Append(
          *context_, request.append(), query, received,
          [pending](const StepLayout& layout, const StepResult& result) {
            pending->WriteWith(6, [&](wire::WireWriter& inner) {  // StreamResponse.append
              WriteAppendResponse(layout, result, inner);
            });
            return absl::OkStatus();
          },
          done);
    }
    case v1::StreamRequest::kForkSession:
      return done(
          sessions_.Fork(*context_, request.fork_session(), pending->message.mutable_session()));
    case v1::StreamRequest::kCloseSession:
      return done(sessions_.Close(*context_, request.close_session(),
                                  pending->message.mutable_close_session()));
    default:
      return done(absl::InvalidArgumentError(
          "stream message: set one of attend, open_session, append, close_session, "
          "fork_session"));
  }
}

void StreamReactor::Answer(const std::shared_ptr<Pending>& pending, const absl::Status& status) {
  v1::StreamResponse& message = pending->message;
  if (!status.ok()) {
    message.clear_message();
    message.set_code(static_cast<int>(status.code()));
    message.set_error_message(MessageOf(status));
    pending->out->response = MessageBytes(message);
  } else if (!pending->written) {
    pending->out->response = MessageBytes(message);
  }
  Reply(pending->out);
}

}  // namespace mha::server
