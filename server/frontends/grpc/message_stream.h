// The plumbing of a bidirectional stream of independent messages (mha.v1
// Stream, KServe ModelStreamInfer): read, start each message, write each
// answer when it is ready, one write at a time, finish when all are
// answered. The front end says how a message starts and how an error reads.
#ifndef MHA_SERVER_FRONTENDS_MESSAGE_STREAM_H_
#define MHA_SERVER_FRONTENDS_MESSAGE_STREAM_H_

#include <deque>
#include <memory>
#include <utility>

#include "engine/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

// One stream call. At most kMaxInFlight messages are started and
// unanswered: beyond, it stops reading until one is answered. Owns itself:
// gRPC calls OnDone only after Finish, and Finish comes only once every
// started message was answered, so no answer outlives it. Thread-safe:
// answers arrive on any thread. A subclass calls StartReading() last in its
// constructor and answers every Start exactly once with Reply.
template <typename Request, typename Response>
class MessageStream : public grpc::ServerBidiReactor<Request, Response> {
 public:
  static constexpr int kMaxInFlight = 64;

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 protected:
  // An answer in the making: the response, and memory held until written.
  struct Outbound {
    Response response;
    std::shared_ptr<MemoryReservation> memory;
  };

  void StartReading() { this->StartRead(&read_); }
  virtual void Start(std::shared_ptr<Request> request) = 0;
  // Queues `out`, written when its turn comes.
  void Reply(std::shared_ptr<Outbound> out);

 private:
  // Whether to Finish now (then marks it done). With mu_ held.
  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Request read_;  // the read in progress
  Mutex mu_;
  std::deque<std::shared_ptr<Outbound>> queue_ ABSL_GUARDED_BY(mu_);  // front: being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // started, unanswered
};

template <typename Request, typename Response>
void MessageStream<Request, Response>::OnReadDone(bool ok) {
  if (!ok) {  // the client half-closed, or the call ended
    bool finish = false;
    {
      MutexLock lock(mu_);
      reads_done_ = true;
      finish = ShouldFinishLocked();
    }
    if (finish) this->Finish(grpc::Status::OK);
    return;
  }
  auto request = std::make_shared<Request>(std::move(read_));
  read_.Clear();
  bool read_more = false;
  {
    MutexLock lock(mu_);
    ++in_flight_;
    read_more = in_flight_ < kMaxInFlight;
    read_paused_ = !read_more;
  }
  Start(std::move(request));
  if (read_more) this->StartRead(&read_);
}

template <typename Request, typename Response>
void MessageStream<Request, Response>::Reply(std::shared_ptr<Outbound> out) {
  const Response* write = nullptr;
  bool resume = false, finish = false;
  {
    MutexLock lock(mu_);
    --in_flight_;
    if (!write_failed_) {
      queue_.push_back(std::move(out));
      if (!writing_) {
        writing_ = true;
        write = &queue_.front()->response;
      }
    }
    resume = read_paused_ && !reads_done_ && !write_failed_ && in_flight_ < kMaxInFlight;
    if (resume) read_paused_ = false;
    finish = ShouldFinishLocked();
  }
  if (write != nullptr) this->StartWrite(write);
  if (resume) this->StartRead(&read_);
  if (finish) this->Finish(grpc::Status::OK);
}

template <typename Request, typename Response>
void MessageStream<Request, Response>::OnWriteDone(bool ok) {
  const Response* next = nullptr;
  bool finish = false;
  {
    MutexLock lock(mu_);
    queue_.pop_front();
    if (!ok) {  // the client went away: answers have nowhere to go
      write_failed_ = true;
      queue_.clear();
    }
    if (!queue_.empty()) {
      next = &queue_.front()->response;
    } else {
      writing_ = false;
    }
    finish = ShouldFinishLocked();
  }
  if (next != nullptr) this->StartWrite(next);
  if (finish) this->Finish(grpc::Status::OK);
}

template <typename Request, typename Response>
bool MessageStream<Request, Response>::ShouldFinishLocked() {
  // With reads paused after a failed write no read will complete: the
  // stream is over once its messages are answered.
  const bool reading_over = reads_done_ || (write_failed_ && read_paused_);
  if (finished_ || !reading_over || in_flight_ > 0 || writing_) return false;
  finished_ = true;
  return true;
}

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_MESSAGE_STREAM_H_
