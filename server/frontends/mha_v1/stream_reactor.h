// mha.v1 Stream: one bidirectional stream of Attend, OpenSession, Append and
// CloseSession messages, each answered with its id.
#ifndef MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_
#define MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_

#include <memory>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/grpc/grpc_helpers.h"
#include "server/frontends/grpc/message_stream.h"
#include "server/frontends/mha_v1/session_calls.h"

namespace mha::server {

// One Stream call (see MessageStream for reading, writing and lifetime),
// its messages read and written around their tensors' bytes (proto/wire/):
// Attend messages go through the front-end gate, session messages through
// SessionCalls; a message's error (one that does not parse included) is
// its answer's code and error_message, never the end of the stream.
// Borrows the front-end gate and the session calls.
class StreamReactor final : public MessageStream<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(grpc::CallbackServerContext* context, FrontEndGate& gate, SessionCalls& sessions)
      : context_(context), gate_(gate), sessions_(sessions) {
    StartReading();
  }

 private:
  class AttendMessage;  // an attend message's call
  struct Pending;       // a message's answer in the making

  void Start(std::shared_ptr<grpc::ByteBuffer> bytes) override;
  // Sets `status` as the answer's code (and error), writes what was not
  // written yet, and replies.
  void Answer(const std::shared_ptr<Pending>& pending, const absl::Status& status);

  grpc::CallbackServerContext* const context_;
  FrontEndGate& gate_;
  SessionCalls& sessions_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_STREAM_REACTOR_H_
