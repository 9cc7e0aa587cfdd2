// The batcher on a real engine with session steps: the cap on Attend tokens
// while sessions step, steps first, yields of long calls, refused and
// expired steps, long requests in chunks beside steps.
#include "tests/server/scheduling/batcher_fixture.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

// A suite of its own: each file's BatcherTest is its own class where the
// files are compiled apart (gtest wants one fixture class per suite).
class BatcherStepsTest : public BatcherTest {};

TEST_F(BatcherStepsTest, WhileSessionsStepCallsCarryAtMostTheCapOfAttendTokens) {
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
TEST_F(BatcherStepsTest, HigherPriorityLevelsAreServedFirst) {
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

TEST_F(BatcherStepsTest, TheCapEndsWhenSessionsStopStepping) {
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
TEST_F(BatcherStepsTest, AStepWaitsAtMostOneCappedCall) {
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
TEST_F(BatcherStepsTest, PollStepsHandsTheReadyStepsAloneNotTheQueuedRequests) {
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
TEST_F(BatcherStepsTest, ACallNobodyWaitsForStopsAtItsNextYieldPoint) {
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
TEST_F(BatcherStepsTest, ACallSharedWithALiveRequestGoesOn) {
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

TEST_F(BatcherStepsTest, ALongCallYieldsToAStepThatArrivesWhileItRuns) {
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
TEST_F(BatcherStepsTest, StepsNeverRideWithALongRequestThatRunsWhole) {
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

TEST_F(BatcherStepsTest, ExpiredAndCancelledStepsAreRefusedBeforeCompute) {
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
TEST_F(BatcherStepsTest, AStepBehindARefusedStepOfItsSessionRuns) {
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
TEST_F(BatcherStepsTest, LongRequestsGoInChunksOfQueryRowsWhileSessionsStep) {
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
