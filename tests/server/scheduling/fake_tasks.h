// Tasks for the scheduler's part tests, with no engine behind them: a
// session step whose owner's answers the test sets, and a projection that
// records whether it ran. What became of each outlives it (the scheduler
// destroys a task once answered).
#ifndef MHA_TESTS_SERVER_SCHEDULING_FAKE_TASKS_H_
#define MHA_TESTS_SERVER_SCHEDULING_FAKE_TASKS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/scheduling/task.h"

namespace mha::testing {

// When the part tests queue tasks (no clock needed).
inline const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

// What happened to a fake task. Not thread-safe (the part tests run one
// thread).
struct Outcome {
  int begun = 0, allocated = 0, abandoned = 0, ran = 0;
  std::optional<absl::Status> answer;  // Fail's or Finish's
  std::vector<std::string> dropped;    // CountDropped's reasons
};

// A session step of `tokens` rows on `session`. Begin answers `start`
// (with `refusal` when kRefused, `active` bytes when kRun); Allocate
// returns `allocate`.
class FakeStep final : public server::StepTask {
 public:
  FakeStep(const void* session, int64_t tokens, std::shared_ptr<Outcome> outcome)
      : session_(session), tokens_(tokens), outcome_(std::move(outcome)) {}
  Start start = Start::kRun;
  absl::Status refusal = absl::FailedPreconditionError("session refused the step");
  absl::Status allocate;
  int64_t active = 0;
  bool chunk = false;  // a chunk of a split request (attend_rows)
  bool cancelled = false;

  bool Cancelled() const override { return cancelled; }
  const void* session() const override { return session_; }
  int64_t tokens() const override { return tokens_; }
  bool attend_rows() const override { return chunk; }
  void CountDropped(const server::ModelMetrics&, const char* reason) override {
    outcome_->dropped.push_back(reason);
  }
  Start Begin(server::StepPlan& plan, absl::Status& why) override {
    ++outcome_->begun;
    if (start == Start::kRefused) why = refusal;
    if (start == Start::kRun) {
      active_bytes = active;
      plan.keys = tokens_;
    }
    return start;
  }
  absl::Status Allocate() override {
    ++outcome_->allocated;
    return allocate;
  }
  void Abandon() override { ++outcome_->abandoned; }
  void Finish(const absl::Status& status, absl::Span<const float>,
              absl::Span<const float>) override {
    outcome_->answer = status;
  }
  void Fail(const absl::Status& status) override { outcome_->answer = status; }

 private:
  const void* session_;
  const int64_t tokens_;
  std::shared_ptr<Outcome> outcome_;
};

// A projection that counts its run and answers OK.
class FakeProjection final : public server::ProjectionTask {
 public:
  explicit FakeProjection(std::shared_ptr<Outcome> outcome) : outcome_(std::move(outcome)) {}
  bool cancelled = false;
  bool Cancelled() const override { return cancelled; }
  void CountDropped(const server::ModelMetrics&, const char* reason) override {
    outcome_->dropped.push_back(reason);
  }
  void Run(Workspace&) override {
    ++outcome_->ran;
    outcome_->answer = absl::OkStatus();
  }
  void Fail(const absl::Status& status) override { outcome_->answer = status; }

 private:
  std::shared_ptr<Outcome> outcome_;
};

}  // namespace mha::testing

#endif  // MHA_TESTS_SERVER_SCHEDULING_FAKE_TASKS_H_
