// mha.v1 Stream: one bidirectional stream of Attend, OpenSession, Append and
// CloseSession messages, each answered with its id.
#ifndef MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_
#define MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_

#include <memory>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/front_end_gate.h"
#include "server/frontends/message_stream.h"
#include "server/frontends/session_calls.h"

namespace mha::server {

// One Stream call (see MessageStream for reading, writing and lifetime):
// Attend messages go through the front-end gate, session messages through
// SessionCalls; a message's error is its answer's code and error_message,
// never the end of the stream. Borrows the front-end gate and the session calls.
class StreamReactor final : public MessageStream<v1::StreamRequest, v1::StreamResponse> {
 public:
  StreamReactor(grpc::CallbackServerContext* context, FrontEndGate& gate, SessionCalls& sessions)
      : context_(context), gate_(gate), sessions_(sessions) {
    StartReading();
  }

 private:
  class AttendMessage;  // an attend message's call

  void Start(std::shared_ptr<v1::StreamRequest> request) override;
  // Sets `status` as the answer's code (and error) and replies.
  void Answer(std::shared_ptr<Outbound> out, const absl::Status& status);

  grpc::CallbackServerContext* const context_;
  FrontEndGate& gate_;
  SessionCalls& sessions_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_
