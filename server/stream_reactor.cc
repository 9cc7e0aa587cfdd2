#include "server/stream_reactor.h"

#include <utility>

#include "server/attention_service.h"
#include "server/request_codec.h"

namespace mha::server {

StreamReactor::StreamReactor(grpc::CallbackServerContext* context, AttendDispatcher& dispatcher,
                             SessionCalls& sessions)
    : context_(context), dispatcher_(dispatcher), sessions_(sessions) {
  StartRead(&read_);
}

void StreamReactor::OnReadDone(bool ok) {
  if (!ok) {  // the client half-closed, or the call ended
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reads_done_ = true;
      finish = ShouldFinishLocked();
    }
    if (finish) Finish(grpc::Status::OK);
    return;
  }
  auto request = std::make_shared<v1::StreamRequest>(std::move(read_));
  read_.Clear();
  bool read_more = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
    read_more = in_flight_ < kMaxInFlight;
    read_paused_ = !read_more;
  }
  Start(std::move(request));
  if (read_more) StartRead(&read_);
}

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
  const v1::StreamResponse* write = nullptr;
  bool resume = false, finish = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  if (write != nullptr) StartWrite(write);
  if (resume) StartRead(&read_);
  if (finish) Finish(grpc::Status::OK);
}

void StreamReactor::OnWriteDone(bool ok) {
  const v1::StreamResponse* next = nullptr;
  bool finish = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  if (next != nullptr) StartWrite(next);
  if (finish) Finish(grpc::Status::OK);
}

bool StreamReactor::ShouldFinishLocked() {
  // With reads paused after a failed write no read will complete: the
  // stream is over once its messages are answered.
  const bool reading_over = reads_done_ || (write_failed_ && read_paused_);
  if (finished_ || !reading_over || in_flight_ > 0 || writing_) return false;
  finished_ = true;
  return true;
}

}  // namespace mha::server
