// mha.v1 Stream: one bidirectional stream of Attend, OpenSession, Append and
// CloseSession messages, each answered with its id.
#ifndef MHA_SERVER_STREAM_REACTOR_H_
#define MHA_SERVER_STREAM_REACTOR_H_

#include <deque>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "server/attend_dispatch.h"
#include "server/session_calls.h"

namespace mha::server {

// One Stream call. Reads messages, starts each (Attend through the
// dispatcher, session messages through SessionCalls) and writes each answer
// when it is ready, one write at a time; a message's error is its answer's
// code and text, never the end of the stream. At most kMaxInFlight messages
// are started and unanswered: beyond, it stops reading until one is
// answered. Owns itself: gRPC calls OnDone only after Finish, and Finish
// comes only once every started message was answered, so no answer
// outlives it. Borrows the dispatcher and the session calls. Thread-safe:
// answers arrive on batcher and session workers.
class StreamReactor : public grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  static constexpr int kMaxInFlight = 64;

  StreamReactor(grpc::CallbackServerContext* context, AttendDispatcher& dispatcher,
                SessionCalls& sessions);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  struct Outbound {
    v1::StreamResponse response;
    std::shared_ptr<MemoryReservation> memory;  // an Attend's, until written
  };

  void Start(std::shared_ptr<v1::StreamRequest> request);
  // Queues `out` with `status` as its code and writes it when its turn comes.
  void Answer(std::shared_ptr<Outbound> out, const absl::Status& status);
  // Whether to Finish now (then marks it done). With mu_ held.
  bool ShouldFinishLocked();

  grpc::CallbackServerContext* const context_;
  AttendDispatcher& dispatcher_;
  SessionCalls& sessions_;
  v1::StreamRequest read_;  // the read in progress

  std::mutex mu_;
  std::deque<std::shared_ptr<Outbound>> queue_;  // front: being written; guarded
  bool writing_ = false;                         // guarded by mu_
  bool reads_done_ = false;                      // guarded by mu_
  bool read_paused_ = false;                     // guarded by mu_
  bool write_failed_ = false;                    // guarded by mu_
  bool finished_ = false;                        // guarded by mu_
  int in_flight_ = 0;                            // started, unanswered; guarded
};

}  // namespace mha::server

#endif  // MHA_SERVER_STREAM_REACTOR_H_
