// CallFormer: what the next engine call takes from the lanes, with no
// worker running it: projections alone, when a batch closes, which requests
// join it, the cap while sessions step, splits, and the memory budget.
#include "server/scheduling/call_former.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/observability/metrics.h"
#include "tests/server/attend_requests.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/fake_tasks.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;
using testing::Outcome;

class CallFormerTest : public ::testing::Test {
 protected:
  CallFormerTest() {
    engine_ = MhaEngine::Create(Dims(), testing::RandomWeights(Dims(), 3)).value();
    options_.max_queue_delay = absl::Milliseconds(10);
    options_.max_batch_tokens = 100;
    options_.max_batch_tokens_with_steps = 40;
    options_.clock = &clock_;
  }
  // Made once the options are set.
  CallFormer& Former() {
    former_ = std::make_unique<CallFormer>(
        *engine_, options_, CallTokens::Resolve(options_, /*threads_per_call=*/1), model_, clock_,
        [this] { return sessions_step_; }, [](std::vector<std::unique_ptr<StepTask>>) {});
    return *former_;
  }
  // Queues a self-attention request of `len` tokens (2 × len query + key).
  AttendCall& Queue(int64_t len, bool need_weights = false, int64_t active_bytes = 0) {
    v1::AttendRequest wire = Request(len, static_cast<uint32_t>(len));
    wire.set_need_weights(need_weights);
    std::unique_ptr<Task> call = testing::MakeCall(DecodeOwned(wire), [](auto) {});
    call->active_bytes = active_bytes;
    AttendCall& queued = *static_cast<AttendCall*>(call.get());
    EXPECT_TRUE(lanes_.Admit(call, clock_.Now()).ok());
    return queued;
  }
  void QueueStep() {
    std::unique_ptr<Task> step = std::make_unique<testing::FakeStep>(this, 1, outcome_);
    EXPECT_TRUE(lanes_.Admit(step, clock_.Now()).ok());
  }
  static std::vector<int64_t> Lengths(const CallPlan& call) {
    std::vector<int64_t> lengths;
    for (const auto& r : call.batch) lengths.push_back(r->input().q_len());
    return lengths;
  }

  std::unique_ptr<MhaEngine> engine_;
  Metrics metrics_;
  ModelMetrics& model_ = metrics_.ForModel("m");
  testing::ManualClock clock_;
  BatcherOptions options_;
  TaskLanes lanes_{"m", options_, model_};
  bool sessions_step_ = false;
  std::shared_ptr<Outcome> outcome_ = std::make_shared<Outcome>();
  std::unique_ptr<CallFormer> former_;
  PoolQueue::Idle idle_;
};

TEST_F(CallFormerTest, ProjectionsGoFirstAndAlone) {
  CallFormer& former = Former();
  Queue(10);
  std::unique_ptr<Task> p = std::make_unique<testing::FakeProjection>(outcome_);
  ASSERT_TRUE(lanes_.Admit(p, clock_.Now()).ok());
  CallPlan call;
  ASSERT_TRUE(former.Form(lanes_, /*stopping=*/true, call, idle_));
  EXPECT_EQ(call.projections.size(), 1);
  EXPECT_TRUE(call.batch.empty());
  EXPECT_EQ(lanes_.requests().size(), 1);
}

TEST_F(CallFormerTest, ABatchClosesOnceItsOldestWaitedTheDelayOrItIsFull) {
  CallFormer& former = Former();
  const AttendCall& first = Queue(10);  // 20 tokens of a limit of 100
  CallPlan call;
  EXPECT_FALSE(former.Form(lanes_, false, call, idle_));
  EXPECT_EQ(idle_.retry_at, first.enqueued + absl::Milliseconds(10));
  clock_.Advance(absl::Milliseconds(10));
  ASSERT_TRUE(former.Form(lanes_, false, call, idle_));
  EXPECT_EQ(Lengths(call), std::vector<int64_t>{10});
  // Full: 100 tokens wait, with no delay passed; the next does not fit.
  for (int64_t len : {11, 12, 13}) Queue(len);
  EXPECT_FALSE(former.BatchReady(lanes_, false, false));  // 72 tokens
  Queue(14);
  EXPECT_TRUE(former.BatchReady(lanes_, false, false));
  Queue(5);
  CallPlan full;
  ASSERT_TRUE(former.Form(lanes_, false, full, idle_));
  EXPECT_EQ(Lengths(full), (std::vector<int64_t>{11, 12, 13, 14}));  // 100 tokens
  EXPECT_EQ(lanes_.requests().size(), 1);
}

TEST_F(CallFormerTest, RequestsOfAnotherSignatureNeitherFillNorJoinTheBatch) {
  CallFormer& former = Former();
  Queue(10);
  Queue(45, /*need_weights=*/true);  // 90 tokens, another signature
  Queue(12);
  EXPECT_GE(lanes_.queued_tokens(), 100);
  EXPECT_FALSE(former.BatchReady(lanes_, false, false));  // 44 tokens join the oldest
  CallPlan call;
  ASSERT_TRUE(former.Form(lanes_, /*stopping=*/true, call, idle_));
  EXPECT_EQ(Lengths(call), (std::vector<int64_t>{10, 12}));  // passed over, however large
  EXPECT_EQ(lanes_.requests().front()->input().q_len(), 45);
}

TEST_F(CallFormerTest, WhileSessionsStepACallTakesAtMostTheCap) {
  CallFormer& former = Former();
  EXPECT_EQ(former.TokenLimit(), 100);
  sessions_step_ = true;
  EXPECT_EQ(former.TokenLimit(), 40);
  for (int64_t len : {10, 10, 10}) Queue(len);
  EXPECT_TRUE(former.BatchReady(lanes_, false, false));  // 40 of 60 tokens join
  CallPlan call;
  ASSERT_TRUE(former.Form(lanes_, false, call, idle_));
  EXPECT_EQ(Lengths(call), (std::vector<int64_t>{10, 10}));
}

TEST_F(CallFormerTest, ReadyStepsCloseTheBatchAndRideAlong) {
  CallFormer& former = Former();
  Queue(10);
  QueueStep();
  CallPlan call;
  ASSERT_TRUE(former.Form(lanes_, false, call, idle_));  // no delay waited
  EXPECT_TRUE(call.steps);
  EXPECT_EQ(Lengths(call), std::vector<int64_t>{10});
  EXPECT_FALSE(lanes_.steps_ready());  // taken by this call
}

TEST_F(CallFormerTest, ALongRequestThatCannotSplitLetsReadyStepsGoFirstOnce) {
  CallFormer& former = Former();
  sessions_step_ = true;
  Queue(60, /*need_weights=*/true);  // 60 query rows over the cap of 40; weights: whole
  EXPECT_TRUE(former.RunsWholeBesideSteps(lanes_));
  EXPECT_FALSE(former.SplitsOldest(lanes_));
  QueueStep();
  CallPlan first;
  ASSERT_TRUE(former.Form(lanes_, false, first, idle_));
  EXPECT_TRUE(first.steps);  // steps alone, the request stays first
  EXPECT_TRUE(first.batch.empty());
  EXPECT_TRUE(lanes_.MarkStepsReady());  // the step still waits
  CallPlan second;
  ASSERT_TRUE(former.Form(lanes_, false, second, idle_));
  EXPECT_FALSE(second.steps);  // the request alone; the steps stay ready
  EXPECT_EQ(Lengths(second), std::vector<int64_t>{60});
  EXPECT_TRUE(lanes_.steps_ready());
}

TEST_F(CallFormerTest, ALongSplittableRequestGoesInChunksWhileSessionsStep) {
  CallFormer& former = Former();
  Queue(60);
  EXPECT_FALSE(former.SplitsOldest(lanes_));  // no session steps
  sessions_step_ = true;
  EXPECT_TRUE(former.SplitsOldest(lanes_));
  CallPlan call;
  ASSERT_TRUE(former.Form(lanes_, /*stopping=*/true, call, idle_));
  EXPECT_EQ(call.projections.size(), 1);  // projects its keys, then queues chunks
  EXPECT_TRUE(call.batch.empty());
  EXPECT_TRUE(lanes_.requests().empty());
  EXPECT_EQ(model_.split_requests->Value(), 1);
}

TEST_F(CallFormerTest, TheOldestWaitsForMemoryCallsWillReturnElseLeavesRefused) {
  MemoryBudget budget(1000);
  options_.memory = &budget;
  CallFormer& former = Former();
  Queue(10, false, /*active_bytes=*/800);
  MemoryReservation computing;
  ASSERT_EQ(budget.TryGrowActive(500, computing), MemoryBudget::Growth::kGrown);
  CallPlan call;
  EXPECT_FALSE(former.Form(lanes_, /*stopping=*/true, call, idle_));
  EXPECT_TRUE(idle_.waiting_for_memory);
  EXPECT_EQ(lanes_.requests().size(), 1);
  // Held by the queue instead (nothing will come back): it leaves refused.
  computing.Release();
  MemoryReservation queued;
  ASSERT_TRUE(budget.TryReserveQueued(500, queued));
  ASSERT_TRUE(former.Form(lanes_, true, call, idle_));
  ASSERT_EQ(call.batch.size(), 1);
  EXPECT_EQ(call.batch[0]->refusal.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(call.batch[0]->refusal.message(), HasSubstr("more to compute"));
  EXPECT_TRUE(lanes_.empty());
}

}  // namespace
}  // namespace mha::server
