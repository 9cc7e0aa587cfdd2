// The batcher tests' fixture: a real engine, requests and session steps
// as the scheduler sees them, a manual clock. Shared by batcher_test.cc
// (Attend calls) and batcher_steps_test.cc (steps beside them).
#ifndef MHA_TESTS_SERVER_SCHEDULING_BATCHER_FIXTURE_H_
#define MHA_TESTS_SERVER_SCHEDULING_BATCHER_FIXTURE_H_

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/frontends/common/request_codec.h"
#include "server/scheduling/batcher.h"
#include "server/scheduling/task.h"
#include "tests/server/attend_requests.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {  // each test file its own copy

// A result copied out of the engine call's buffers (which live only
// during `done`).
struct Answer {
  std::vector<float> output, weights;
};

absl::StatusOr<Answer> Keep(const absl::StatusOr<AttentionResult>& result) {
  if (!result.ok()) return result.status();
  return Answer{{result->output.begin(), result->output.end()},
                {result->weights.begin(), result->weights.end()}};
}

// A session step as the scheduler sees one, on a cache of its own: starts
// at once, appends `tokens` random rows, and records its answer and how
// many engine calls `calls` counted when it was answered.
class TestStep final : public StepTask {
 public:
  TestStep(const MhaEngine& engine, int64_t tokens, std::function<double()> calls)
      : pool_(int64_t{4} << 20),
        cache_(engine.kv_layout(), pool_),
        query_(testing::RandomVector(tokens * engine.dims().embed_dim, 5)),
        tokens_(tokens),
        calls_(std::move(calls)) {}
  std::future<absl::Status> answer() { return answer_.get_future(); }
  // Outlive the step (the batcher destroys it once answered).
  std::shared_ptr<double> calls_at_answer = std::make_shared<double>(-1);
  std::function<bool()> cancelled;
  // Which session it steps (default: its own); a refusal Begin gives; a
  // gate its Finish waits for (holding the worker), after `finishing`.
  const void* session_key = nullptr;
  absl::Status refuse_with;
  std::shared_future<void> gate;
  std::promise<void>* finishing = nullptr;

  bool Cancelled() const override { return cancelled && cancelled(); }
  const void* session() const override { return session_key ? session_key : this; }
  int64_t tokens() const override { return tokens_; }
  void CountDropped(const ModelMetrics&, const char*) override {}
  Start Begin(StepPlan& plan, absl::Status& why) override {
    if (!refuse_with.ok()) {
      why = refuse_with;
      return Start::kRefused;
    }
    plan.step = CacheStep{&cache_, tokens_, false};
    plan.query = query_;
    plan.keys = cache_.length() + tokens_;
    return Start::kRun;
  }
  absl::Status Allocate() override { return cache_.Reserve(cache_.length() + tokens_); }
  void Abandon() override {}
  void Finish(const absl::Status& status, absl::Span<const float>,
              absl::Span<const float>) override {
    *calls_at_answer = calls_();
    if (finishing != nullptr) finishing->set_value();
    if (gate.valid()) gate.wait();
    answer_.set_value(status);
  }
  void Fail(const absl::Status& status) override { answer_.set_value(status); }

 private:
  KvBlockPool pool_;
  KvCache cache_;
  std::vector<float> query_;
  const int64_t tokens_;
  std::function<double()> calls_;
  std::promise<absl::Status> answer_;
};

// An engine, metrics and decoded requests for batcher tests.
class BatcherTest : public ::testing::Test {
 protected:
  BatcherTest() { engine_ = MhaEngine::Create(Dims(), testing::RandomWeights(Dims(), 3)).value(); }

  // The answer of one request computed alone.
  std::vector<float> Alone(const v1::AttendRequest& r) {
    AttentionRequest d = DecodeOwned(r);
    std::vector<float> out(d.output_elements());
    auto ws = engine_->NewWorkspace();
    EXPECT_TRUE(engine_->Run(d.batch(), {absl::MakeSpan(out), {}, false}, *ws).ok());
    return out;
  }

  // Enqueues and returns a future of the result.
  std::future<absl::StatusOr<Answer>> Submit(Batcher& b, const v1::AttendRequest& r,
                                             absl::Time deadline = absl::InfiniteFuture(),
                                             std::function<bool()> cancelled = {}) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<Answer>>>();
    auto p = testing::MakeCall(
        DecodeOwned(r),
        [promise](absl::StatusOr<AttentionResult> result) { promise->set_value(Keep(result)); },
        std::move(cancelled));
    p->deadline = deadline;
    b.Enqueue(std::move(p));  // a refusal comes through Fail, at once
    return promise->get_future();
  }

  double BatchCount() {
    return metrics_.ForModel("m").batch_requests->Collect().histogram.sample_count;
  }

  // Queues a step of `tokens`; its answer comes through the future.
  std::future<absl::Status> Step(Batcher& b, Metrics& metrics, int64_t tokens = 1,
                                 std::shared_ptr<double>* calls_at_answer = nullptr) {
    ModelMetrics& m = metrics.ForModel("m");
    auto step = std::make_unique<TestStep>(*engine_, tokens, [&m] {
      return static_cast<double>(m.compute_duration->Collect().histogram.sample_count);
    });
    std::future<absl::Status> answer = step->answer();
    if (calls_at_answer != nullptr) *calls_at_answer = step->calls_at_answer;
    b.Enqueue(std::move(step));
    return answer;
  }

  // Options whose queue delay only the test's clock can end.
  BatcherOptions Delayed(absl::Duration delay) {
    BatcherOptions options;
    options.max_queue_delay = delay;
    options.clock = &clock_;
    return options;
  }
  // Enqueues a step whose answer holds `batcher`'s worker until `open_gate`
  // is set; returns once the worker holds (it has set `finishing`), with the
  // step's answer to come.
  static std::future<absl::Status> HoldWorker(Batcher& batcher, const MhaEngine& engine,
                                              std::promise<void>& open_gate,
                                              std::promise<void>& finishing) {
    auto holder = std::make_unique<TestStep>(engine, 1, [] { return 0.0; });
    holder->gate = open_gate.get_future().share();
    holder->finishing = &finishing;
    std::future<absl::Status> held = holder->answer();
    batcher.Enqueue(std::move(holder));
    finishing.get_future().wait();
    return held;
  }
  // Calls wait (30 s) for 1M tokens, or for 100 while sessions step.
  BatcherOptions CappedWhileStepping() {
    BatcherOptions options = Delayed(absl::Seconds(30));
    options.max_batch_tokens = 1 << 20;
    options.max_batch_tokens_with_steps = 100;
    return options;
  }

  std::unique_ptr<MhaEngine> engine_;
  Metrics metrics_;
  testing::ManualClock clock_;
};

}  // namespace
}  // namespace mha::server

#endif  // MHA_TESTS_SERVER_SCHEDULING_BATCHER_FIXTURE_H_
