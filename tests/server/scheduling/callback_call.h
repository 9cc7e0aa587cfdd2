// An AttendCall for tests: answers through a function, as the batcher's
// callers once did.
#ifndef MHA_TESTS_CALLBACK_CALL_H_
#define MHA_TESTS_CALLBACK_CALL_H_

#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "server/scheduling/attend_call.h"

namespace mha::testing {

// Calls `done` once, with the result (views valid during the call) or the
// error; `cancelled` (may be empty) says whether the caller is gone.
class CallbackCall final : public server::AttendCall {
 public:
  using Done = std::function<void(absl::StatusOr<server::AttentionResult>)>;
  CallbackCall(AttentionRequest input, Done done, std::function<bool()> cancelled = {})
      : done_(std::move(done)), cancelled_(std::move(cancelled)) {
    SetInput(std::move(input));
  }
  bool Cancelled() const override { return cancelled_ && cancelled_(); }
  bool SendsConvertedOutput() const override { return sends_converted; }
  // What SendsConvertedOutput says (as the gRPC front ends' calls do).
  bool sends_converted = false;

 private:
  absl::Status Encode(const server::AttentionResult& result) override {
    result_ = result;
    return absl::OkStatus();
  }
  void Finish(const absl::Status& status) override {
    if (status.ok()) {
      done_(result_);
    } else {
      done_(status);
    }
  }

  Done done_;
  std::function<bool()> cancelled_;
  server::AttentionResult result_;
};

inline std::unique_ptr<CallbackCall> MakeCall(AttentionRequest input, CallbackCall::Done done,
                                              std::function<bool()> cancelled = {}) {
  return std::make_unique<CallbackCall>(std::move(input), std::move(done), std::move(cancelled));
}

}  // namespace mha::testing

#endif  // MHA_TESTS_CALLBACK_CALL_H_
