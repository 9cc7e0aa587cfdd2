// The batcher on a real engine: calls formed from concurrent requests and
// session steps, limits, priorities, drops and the cap while sessions step.
#include "server/scheduling/batcher.h"

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
#include "server/frontends/request_codec.h"
#include "server/scheduling/task.h"
#include "tests/server/attend_requests.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

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

TEST_F(BatcherTest, ConcurrentRequestsShareEngineCallsAndGetTheirOwnAnswers) {
  Batcher batcher("m", *engine_, Delayed(absl::Milliseconds(200)), metrics_.ForModel("m"));
  std::vector<v1::AttendRequest> requests;
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 8; ++i) {
    requests.push_back(Request(1 + 3 * i, 10 + i, /*key_padding=*/i % 2 == 0));
    results.push_back(Submit(batcher, requests.back()));
  }
  clock_.Advance(absl::Milliseconds(200));
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<Answer> r = results[i].get();
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<float> expected = Alone(requests[i]);
    ASSERT_EQ(r->output.size(), expected.size());
    for (size_t j = 0; j < expected.size(); ++j) EXPECT_NEAR(r->output[j], expected[j], 1e-5);
  }
  EXPECT_EQ(BatchCount(), 1);  // 184 tokens, one signature: one engine call
}

TEST_F(BatcherTest, BatchingOffRunsOneRequestPerCall) {
  BatcherOptions options;
  options.enabled = false;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 5; ++i) results.push_back(Submit(batcher, Request(4, i)));
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  EXPECT_EQ(BatchCount(), 5);
}

TEST_F(BatcherTest, DefaultTokenCapIs1024PerThreadOfACall) {
  // Requests of 400 tokens (L = 200, query + key); batches close on size
  // only (or at Stop). 1 thread per call: 2 fit under 1,024, so 6 requests
  // take 3 calls; 2 threads: 5 fit under 2,048, so 2 calls.
  for (int threads : {1, 2}) {
    Metrics metrics;
    BatcherOptions options;
    options.compute_threads = threads;
    options.max_queue_delay = absl::Seconds(30);
    Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
    std::vector<std::future<absl::StatusOr<Answer>>> results;
    for (int i = 0; i < 6; ++i) results.push_back(Submit(batcher, Request(200, i)));
    batcher.Stop();
    for (auto& r : results) EXPECT_TRUE(r.get().ok());
    EXPECT_EQ(metrics.ForModel("m").batch_requests->Collect().histogram.sample_count,
              threads == 1 ? 3 : 2)
        << threads << " threads per call";
  }
}

TEST_F(BatcherTest, FullQueueIsResourceExhausted) {
  BatcherOptions options = Delayed(absl::Seconds(1));
  options.max_queue_size = 2;
  options.max_batch_tokens = 1 << 20;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  auto a = Submit(batcher, Request(3, 1));
  auto b = Submit(batcher, Request(3, 2));
  auto c = Submit(batcher, Request(3, 3));
  EXPECT_EQ(c.get().status().code(), absl::StatusCode::kResourceExhausted);
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
}

TEST_F(BatcherTest, QueuedBytesLimitRefusesWhatWouldPassIt) {
  BatcherOptions options = Delayed(absl::Milliseconds(300));  // the first two wait together
  options.max_queue_bytes = 2 * 3 * 24 * 4 + 10;              // two [1, 3, 24] f32 queries
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  auto a = Submit(batcher, Request(3, 1));
  auto b = Submit(batcher, Request(3, 2));
  auto c = Submit(batcher, Request(3, 3));
  const absl::Status refused = c.get().status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("576 bytes waiting, this request 288"));
  clock_.Advance(absl::Milliseconds(300));
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
  // Computed requests give their bytes back.
  auto d = Submit(batcher, Request(3, 4));
  clock_.Advance(absl::Milliseconds(300));
  EXPECT_TRUE(d.get().ok());
}

// Many client threads against two workers, with metrics read meanwhile: the
// threading the server has, without gRPC (the ThreadSanitizer build runs it).
TEST_F(BatcherTest, ManyThreadsAndWorkersGetTheirOwnAnswers) {
  BatcherOptions options;
  options.workers = 2;
  options.compute_threads = 1;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done) BatchCount();
  });
  std::vector<std::thread> clients;
  std::atomic<int> correct{0};
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; i < 12; ++i) {
        const v1::AttendRequest r = Request(1 + (t + i) % 7, 100 * t + i, i % 3 == 0);
        absl::StatusOr<Answer> got = Submit(batcher, r).get();
        if (!got.ok()) continue;
        const std::vector<float> expected = Alone(r);
        bool same = got->output.size() == expected.size();
        for (size_t j = 0; same && j < expected.size(); ++j) {
          same = std::fabs(got->output[j] - expected[j]) <= 1e-5f;
        }
        correct += same;
      }
    });
  }
  for (std::thread& c : clients) c.join();
  done = true;
  reader.join();
  EXPECT_EQ(correct, 4 * 12);
}

TEST_F(BatcherTest, ExpiredAndCancelledRequestsAreDroppedBeforeCompute) {
  Batcher batcher("m", *engine_, Delayed(absl::Milliseconds(50)), metrics_.ForModel("m"));
  auto expired = Submit(batcher, Request(3, 1), clock_.Now() + absl::Milliseconds(1));
  auto cancelled = Submit(batcher, Request(3, 2), absl::InfiniteFuture(), [] { return true; });
  auto live = Submit(batcher, Request(3, 3), clock_.Now() + absl::Milliseconds(60));
  clock_.Advance(absl::Milliseconds(50));
  EXPECT_EQ(expired.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(live.get().ok());
}

TEST_F(BatcherTest, StopComputesWhatIsQueuedThenRefuses) {
  BatcherOptions options;
  options.max_queue_delay = absl::Seconds(30);  // only Stop can close the batch
  options.max_batch_tokens = 1 << 20;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  auto a = Submit(batcher, Request(5, 1));
  auto b = Submit(batcher, Request(2, 2));
  batcher.Stop();
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
  EXPECT_EQ(Submit(batcher, Request(2, 3)).get().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, RequestsWithDifferentFlagsAreComputedSeparately) {
  Batcher batcher("m", *engine_, Delayed(absl::Milliseconds(100)), metrics_.ForModel("m"));
  v1::AttendRequest causal = Request(6, 1);
  causal.set_is_causal(true);
  v1::AttendRequest weights = Request(4, 2);
  weights.set_need_weights(true);
  const v1::AttendRequest plain = Request(5, 3);
  auto r1 = Submit(batcher, causal);
  auto r2 = Submit(batcher, weights);
  auto r3 = Submit(batcher, plain);
  clock_.Advance(absl::Milliseconds(100));
  for (auto* f : {&r1, &r2, &r3}) ASSERT_TRUE(f->valid());
  absl::StatusOr<Answer> a = r1.get(), b = r2.get(), c = r3.get();
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(b->weights.size(), 4u * 4u);
  EXPECT_TRUE(a->weights.empty());
  const std::vector<float> expected = Alone(causal);
  for (size_t j = 0; j < expected.size(); ++j) EXPECT_NEAR(a->output[j], expected[j], 1e-5);
}

// A request that cannot join (another signature), however large, neither
// makes the oldest request's batch ready nor closes it: the two compatible
// requests around it share one call.
TEST_F(BatcherTest, OversizedRequestOfAnotherSignatureDoesNotCloseTheBatch) {
  BatcherOptions options = Delayed(absl::Milliseconds(100));
  options.max_batch_tokens = 100;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  v1::AttendRequest large = Request(60, 2);  // 120 tokens: alone above the cap
  large.set_is_causal(true);
  auto a = Submit(batcher, Request(5, 1));
  auto b = Submit(batcher, large);
  auto c = Submit(batcher, Request(5, 3));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(a.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the batch closed before its delay";
  clock_.Advance(absl::Milliseconds(100));
  for (auto* f : {&a, &b, &c}) EXPECT_TRUE(f->get().ok());
  const auto batches = metrics_.ForModel("m").batch_requests->Collect().histogram;
  EXPECT_EQ(batches.sample_count, 2);  // {a, c} and {large}
  EXPECT_EQ(batches.sample_sum, 3);
}

TEST_F(BatcherTest, LoneRequestWithWeightsMatchesTheEngineAlone) {
  Batcher batcher("m", *engine_, BatcherOptions{}, metrics_.ForModel("m"));
  v1::AttendRequest request = Request(6, 4, true);
  request.set_need_weights(true);
  const absl::StatusOr<Answer> r = Submit(batcher, request).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->weights.size(), 6u * 6u);
  const std::vector<float> expected = Alone(request);
  ASSERT_EQ(r->output.size(), expected.size());
  for (size_t j = 0; j < expected.size(); ++j) EXPECT_NEAR(r->output[j], expected[j], 1e-5);
  batcher.Stop();
}

TEST_F(BatcherTest, WhileSessionsStepCallsCarryAtMostTheCapOfAttendTokens) {
  // Six requests of 40 tokens (L = 20, query + key), held by a delay only
  // Stop ends. A step marks the pool's sessions as stepping: calls then
  // take at most 100 tokens, two requests each, and close when they have
  // them without waiting for the delay (a step waits at most for one such
  // call). The last two do not fill a call: Stop sends them.
  const BatcherOptions options = CappedWhileStepping();
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 6; ++i) results.push_back(Submit(batcher, Request(20, i)));
  EXPECT_TRUE(Step(batcher, metrics).get().ok());
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].get().ok());  // the cap closed them
  batcher.Stop();
  for (int i = 4; i < 6; ++i) EXPECT_TRUE(results[i].get().ok());
  const auto batches = metrics.ForModel("m").batch_tokens->Collect().histogram;
  EXPECT_EQ(batches.sample_count, 3);
  EXPECT_EQ(batches.sample_sum, 240);
}

// Triton's priority levels: the queue is served highest level first (1),
// oldest first within a level; 0 or a level above priority_levels means the
// default level.
TEST_F(BatcherTest, HigherPriorityLevelsAreServedFirst) {
  // All wait (no call fills) until Stop, then go in one call, taken and
  // answered in queue order.
  BatcherOptions options = Delayed(absl::Seconds(30));
  options.max_batch_tokens = 1 << 20;
  options.priority_levels = 3;
  options.default_priority_level = 2;
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  std::mutex mu;
  std::vector<std::string> order;
  auto submit = [&](const std::string& name, uint64_t priority, uint32_t seed) {
    auto call = testing::MakeCall(DecodeOwned(Request(20, seed)),
                                  [&, name](absl::StatusOr<AttentionResult> r) {
                                    EXPECT_TRUE(r.ok()) << r.status();
                                    std::lock_guard<std::mutex> lock(mu);
                                    order.push_back(name);
                                  });
    call->priority = priority;
    batcher.Enqueue(std::move(call));
  };
  submit("low", 3, 1);
  submit("default", 0, 2);
  submit("high", 1, 3);
  submit("above_levels", 9, 4);  // the default level, behind "default"
  submit("high_later", 1, 5);
  batcher.Stop();
  EXPECT_EQ(order,
            (std::vector<std::string>{"high", "high_later", "default", "above_levels", "low"}));
}

TEST_F(BatcherTest, TheCapEndsWhenSessionsStopStepping) {
  const BatcherOptions options = CappedWhileStepping();
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  EXPECT_TRUE(Step(batcher, metrics).get().ok());
  clock_.Advance(WorkerPool::kStepsRecent + absl::Milliseconds(1));
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 6; ++i) results.push_back(Submit(batcher, Request(20, i)));
  batcher.Stop();
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  EXPECT_EQ(metrics.ForModel("m").batch_requests->Collect().histogram.sample_count, 1);
}

// Steps go first: a step queued behind a run of Attend requests waits at
// most for the call in progress, then goes first in the next one. Its
// steps are refused, like Attend requests, when their deadline passed or
// their caller cancelled, before anything is computed.
TEST_F(BatcherTest, AStepWaitsAtMostOneCappedCall) {
  const BatcherOptions options = CappedWhileStepping();
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  ASSERT_TRUE(Step(batcher, metrics).get().ok());  // sessions step: the cap holds
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 20; ++i) results.push_back(Submit(batcher, Request(20, i)));
  // The one worker held inside its work (a step's answer, the work's
  // capped requests still to compute) while the step arrives: no call can
  // end between counting the calls and queueing the step.
  std::promise<void> open, finishing;
  std::future<absl::Status> held = HoldWorker(batcher, *engine_, open, finishing);
  const double calls_before =
      metrics.ForModel("m").compute_duration->Collect().histogram.sample_count;
  std::shared_ptr<double> calls_at_answer;
  std::future<absl::Status> answer = Step(batcher, metrics, 1, &calls_at_answer);
  open.set_value();
  ASSERT_TRUE(held.get().ok());
  ASSERT_TRUE(answer.get().ok());
  // The call computing when it arrived, then its own.
  EXPECT_LE(*calls_at_answer, calls_before + 2);
  batcher.Stop();
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  // 20 requests, two per capped call; the two steps rode along or alone.
  EXPECT_EQ(metrics.ForModel("m").batch_requests->Collect().histogram.sample_count, 10);
}

// What a long call's yield runs (PollSteps): the ready steps alone, in a
// call of their own; queued Attend requests, which would ride with them in
// Poll's call, stay queued.
TEST_F(BatcherTest, PollStepsHandsTheReadyStepsAloneNotTheQueuedRequests) {
  const BatcherOptions options = CappedWhileStepping();  // requests wait for a full call
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  EXPECT_EQ(batcher.PollSteps(), nullptr);  // nothing ready
  std::promise<void> open, finishing;
  std::future<absl::Status> held = HoldWorker(batcher, *engine_, open, finishing);
  std::future<absl::StatusOr<Answer>> request = Submit(batcher, Request(20, 1));
  std::future<absl::Status> step = Step(batcher, metrics);
  std::unique_ptr<PoolWork> work = batcher.PollSteps();
  ASSERT_NE(work, nullptr);
  EXPECT_EQ(batcher.PollSteps(), nullptr);  // taken
  work->Run(*engine_->NewWorkspace());
  work.reset();
  EXPECT_TRUE(step.get().ok());
  EXPECT_EQ(request.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  EXPECT_EQ(metrics.ForModel("m").yielded_step_calls->Value(), 1);
  open.set_value();
  EXPECT_TRUE(held.get().ok());
  batcher.Stop();
  EXPECT_TRUE(request.get().ok());
}

// On the engine: a step that arrives while the one worker computes a long
// request (causal: not split) is answered from the long call's yield,
// before the long request is.
// Waits until a worker took what `metrics` counts as queued.
void WaitUntilTaken(Metrics& metrics) {
  while (metrics.ForModel("m").queue_depth->Value() > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

double Calls(Metrics& metrics) {
  return metrics.ForModel("m").compute_duration->Collect().histogram.sample_count;
}

// A started call whose every request is cancelled, or whose deadline
// passes, stops at its next yield point: CANCELLED / DEADLINE_EXCEEDED
// where the whole call used to be computed and answered OK.
TEST_F(BatcherTest, ACallNobodyWaitsForStopsAtItsNextYieldPoint) {
  Metrics metrics;
  Batcher batcher("m", *engine_, Delayed(absl::ZeroDuration()), metrics.ForModel("m"));
  v1::AttendRequest causal = Request(32768, 1);  // seconds of compute here
  causal.set_is_causal(true);
  std::atomic<bool> gone{false};
  auto cancelled = Submit(batcher, causal, absl::InfiniteFuture(), [&gone] { return gone.load(); });
  WaitUntilTaken(metrics);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // inside the engine call
  gone = true;
  absl::StatusOr<Answer> answer = cancelled.get();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kCancelled) << answer.status();
  EXPECT_EQ(Calls(metrics), 1) << "it was computing";

  auto late = Submit(batcher, causal, clock_.Now() + absl::Seconds(1));
  WaitUntilTaken(metrics);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  clock_.Advance(absl::Seconds(2));
  answer = late.get();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded) << answer.status();
  EXPECT_THAT(answer.status().message(), HasSubstr("while the request was computed"));
  EXPECT_EQ(Calls(metrics), 2);
}

// One request of a call cancelled while it runs: the call goes on for the
// other, whose answer is exact.
TEST_F(BatcherTest, ACallSharedWithALiveRequestGoesOn) {
  Metrics metrics;
  BatcherOptions options = Delayed(absl::Seconds(30));
  options.max_batch_tokens = 1 << 20;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  v1::AttendRequest causal = Request(16384, 1), small = Request(5, 2);
  causal.set_is_causal(true);
  small.set_is_causal(true);
  std::atomic<bool> gone{false};
  auto cancelled = Submit(batcher, causal, absl::InfiniteFuture(), [&gone] { return gone.load(); });
  auto live = Submit(batcher, small);
  clock_.Advance(absl::Seconds(30));  // the batch of both closes
  WaitUntilTaken(metrics);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  gone = true;
  const absl::StatusOr<Answer> answer = live.get();
  ASSERT_TRUE(answer.ok()) << answer.status();
  const std::vector<float> expected = Alone(small);
  ASSERT_EQ(answer->output.size(), expected.size());
  for (size_t j = 0; j < expected.size(); ++j) ASSERT_NEAR(answer->output[j], expected[j], 1e-5);
  EXPECT_TRUE(cancelled.get().ok()) << "computed with the live one";
  EXPECT_EQ(Calls(metrics), 1) << "one call for both";
}

TEST_F(BatcherTest, ALongCallYieldsToAStepThatArrivesWhileItRuns) {
  Metrics metrics;
  Batcher batcher("m", *engine_, Delayed(absl::ZeroDuration()), metrics.ForModel("m"));
  ASSERT_TRUE(Step(batcher, metrics).get().ok());  // sessions are in use
  v1::AttendRequest causal = Request(4096, 1);
  causal.set_is_causal(true);
  std::future<absl::StatusOr<Answer>> long_request = Submit(batcher, causal);
  while (metrics.ForModel("m").queue_depth->Value() > 0) {  // until a worker took it
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  std::future<absl::Status> step = Step(batcher, metrics);
  ASSERT_TRUE(step.get().ok());
  EXPECT_EQ(long_request.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout)
      << "the step waited for the whole long call";
  const absl::StatusOr<Answer> answer = long_request.get();
  ASSERT_TRUE(answer.ok()) << answer.status();
  const std::vector<float> expected = Alone(causal);
  ASSERT_EQ(answer->output.size(), expected.size());
  for (size_t j = 0; j < expected.size(); ++j) ASSERT_NEAR(answer->output[j], expected[j], 1e-5);
  EXPECT_EQ(metrics.ForModel("m").yielded_step_calls->Value(), 1);
}

// While sessions step, a request longer than the cap that cannot go in
// chunks (causal here) never carries steps: ready steps go alone before it,
// once; the next time steps are ready it goes alone, leaving them ready,
// and its call's yield runs them (one worker here). It is never passed over
// twice, however many steps come.
TEST_F(BatcherTest, StepsNeverRideWithALongRequestThatRunsWhole) {
  const BatcherOptions options = CappedWhileStepping();  // cap 100 tokens
  Metrics metrics;
  ModelMetrics& m = metrics.ForModel("m");
  Batcher batcher("m", *engine_, options, m);
  auto calls = [&m] {
    return static_cast<double>(m.compute_duration->Collect().histogram.sample_count);
  };
  ASSERT_TRUE(Step(batcher, metrics).get().ok());  // sessions step: the cap holds
  std::promise<void> open_first, first_finishing;
  std::future<absl::Status> held = HoldWorker(batcher, *engine_, open_first, first_finishing);
  v1::AttendRequest causal = Request(101, 3);  // more query rows than the cap
  causal.set_is_causal(true);
  std::promise<double> request_answered_at;
  batcher.Enqueue(testing::MakeCall(DecodeOwned(causal), [&](absl::StatusOr<AttentionResult> r) {
    EXPECT_TRUE(r.ok()) << r.status();
    request_answered_at.set_value(calls());
  }));
  // Step A holds the worker in its answer, so that step B is ready when the
  // worker next looks.
  auto a = std::make_unique<TestStep>(*engine_, 1, calls);
  std::promise<void> open_a, a_finishing;
  a->gate = open_a.get_future().share();
  a->finishing = &a_finishing;
  std::shared_ptr<double> a_at = a->calls_at_answer;
  std::future<absl::Status> a_answer = a->answer();
  batcher.Enqueue(std::move(a));
  open_first.set_value();
  a_finishing.get_future().wait();  // A's call: the steps alone
  std::shared_ptr<double> b_at;
  std::future<absl::Status> b_answer = Step(batcher, metrics, 1, &b_at);
  open_a.set_value();
  EXPECT_TRUE(held.get().ok());
  EXPECT_TRUE(a_answer.get().ok());
  EXPECT_TRUE(b_answer.get().ok());
  const double request_at = request_answered_at.get_future().get();
  EXPECT_LT(*a_at, request_at);
  EXPECT_LT(*b_at, request_at);  // in the request's yield, before its answer
  EXPECT_EQ(m.yielded_step_calls->Value(), 1);
  const auto batches = m.batch_tokens->Collect().histogram;
  EXPECT_EQ(batches.sample_count, 1);  // the request's call: its tokens alone
  EXPECT_EQ(batches.sample_sum, 202);
  batcher.Stop();
}

TEST_F(BatcherTest, ExpiredAndCancelledStepsAreRefusedBeforeCompute) {
  Metrics metrics;
  Batcher batcher("m", *engine_, Delayed(absl::ZeroDuration()), metrics.ForModel("m"));
  auto late = std::make_unique<TestStep>(*engine_, 1, [] { return 0.0; });
  late->deadline = clock_.Now() - absl::Milliseconds(1);
  std::future<absl::Status> late_answer = late->answer();
  batcher.Enqueue(std::move(late));
  EXPECT_EQ(late_answer.get().code(), absl::StatusCode::kDeadlineExceeded);
  auto gone = std::make_unique<TestStep>(*engine_, 1, [] { return 0.0; });
  gone->cancelled = [] { return true; };
  std::future<absl::Status> gone_answer = gone->answer();
  batcher.Enqueue(std::move(gone));
  EXPECT_EQ(gone_answer.get().code(), absl::StatusCode::kCancelled);
  batcher.Stop();
  EXPECT_EQ(metrics.ForModel("m").compute_duration->Collect().histogram.sample_count, 0)
      << "nothing computed";
}

// A refused step lets go of its session: the next step of that session,
// queued behind it, still runs (it is not left in the queue unwoken).
TEST_F(BatcherTest, AStepBehindARefusedStepOfItsSessionRuns) {
  Metrics metrics;
  Batcher batcher("m", *engine_, BatcherOptions{}, metrics.ForModel("m"));
  auto zero = [] { return 0.0; };
  // Hold the one worker in a step's answer while the two queue.
  std::promise<void> open_gate, finishing;
  std::future<absl::Status> held = HoldWorker(batcher, *engine_, open_gate, finishing);
  int session = 0;
  auto refused = std::make_unique<TestStep>(*engine_, 1, zero);
  refused->session_key = &session;
  refused->refuse_with = absl::FailedPreconditionError("not at the expected position");
  auto next = std::make_unique<TestStep>(*engine_, 1, zero);
  next->session_key = &session;
  std::future<absl::Status> refused_answer = refused->answer(), next_answer = next->answer();
  batcher.Enqueue(std::move(refused));
  batcher.Enqueue(std::move(next));
  open_gate.set_value();
  EXPECT_TRUE(held.get().ok());
  EXPECT_EQ(refused_answer.get().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(next_answer.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "the step behind the refused one was never taken";
  EXPECT_TRUE(next_answer.get().ok());
  batcher.Stop();
}

// A cross-attention request: L queries against S keys and values.
v1::AttendRequest CrossRequest(int64_t len, int64_t keys, uint32_t seed) {
  v1::AttendRequest r = Request(len, seed);
  *r.mutable_key() = Wire({1, keys, 24}, testing::RandomVector(keys * 24, seed + 1));
  *r.mutable_value() = Wire({1, keys, 24}, testing::RandomVector(keys * 24, seed + 2));
  return r;
}

// While sessions step, a request with more query rows than the cap goes
// in chunks of the cap's rows (its keys and values projected once), each
// chunk one call beside the steps: a step queued behind it is answered
// first, and the request gets what one call gives (self and cross, key
// padding, bias_kv + add_zero_attn + post-norm).
TEST_F(BatcherTest, LongRequestsGoInChunksOfQueryRowsWhileSessionsStep) {
  AttentionDims extras = Dims();
  extras.add_bias_kv = extras.add_zero_attn = extras.post_norm = true;
  const std::unique_ptr<MhaEngine> extras_engine =
      MhaEngine::Create(extras, testing::RandomWeights(extras, 4)).value();
  struct Case {
    const char* name;
    const MhaEngine* engine;
    v1::AttendRequest request;
  };
  const std::vector<Case> cases = {
      {"self, key padding", engine_.get(), Request(600, 21, /*key_padding=*/true)},
      {"cross", engine_.get(), CrossRequest(600, 77, 22)},
      {"extras", extras_engine.get(), Request(600, 23)}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    BatcherOptions options = Delayed(absl::Seconds(30));
    options.max_batch_tokens = 1 << 20;
    options.max_batch_tokens_with_steps = 64;
    Metrics metrics;
    Batcher batcher("m", *c.engine, options, metrics.ForModel("m"));
    // A step holds the worker (and marks sessions as stepping) while the
    // request and another step queue.
    std::atomic<int> order{0};
    std::promise<void> open_gate, finishing;
    std::future<absl::Status> held = HoldWorker(batcher, *c.engine, open_gate, finishing);
    int request_at = 0;
    std::promise<absl::StatusOr<Answer>> long_answer;
    batcher.Enqueue(
        testing::MakeCall(DecodeOwned(c.request), [&](absl::StatusOr<AttentionResult> r) {
          request_at = ++order;
          long_answer.set_value(Keep(r));
        }));
    auto step =
        std::make_unique<TestStep>(*c.engine, 1, [&order] { return static_cast<double>(++order); });
    std::shared_ptr<double> step_at = step->calls_at_answer;
    std::future<absl::Status> stepped = step->answer();
    batcher.Enqueue(std::move(step));
    open_gate.set_value();
    ASSERT_TRUE(held.get().ok());
    ASSERT_TRUE(stepped.get().ok());
    absl::StatusOr<Answer> r = long_answer.get_future().get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LT(*step_at, request_at) << "the step went before the request's last chunks";
    AttentionRequest alone = DecodeOwned(c.request);
    std::vector<float> expected(alone.output_elements());
    auto ws = c.engine->NewWorkspace();
    ASSERT_TRUE(c.engine->Run(alone.batch(), {absl::MakeSpan(expected), {}, false}, *ws).ok());
    ASSERT_EQ(r->output.size(), expected.size());
    for (size_t j = 0; j < expected.size(); ++j) ASSERT_NEAR(r->output[j], expected[j], 1e-5) << j;
    // The holder's call, then ten chunks of 64 rows, one call each.
    EXPECT_EQ(metrics.ForModel("m").compute_duration->Collect().histogram.sample_count, 11);
    EXPECT_EQ(metrics.ForModel("m").split_requests->Value(), 1);
    batcher.Stop();
  }
}

}  // namespace
}  // namespace mha::server
