// StepStarter: which waiting steps start in the next engine call (one per
// session, oldest first, within the call's tokens and the cap on chunks'
// rows, within the memory budget) and which are refused, through the
// sessions' answers to Begin and Allocate.
#include "server/scheduling/step_starter.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/observability/metrics.h"
#include "tests/server/scheduling/fake_tasks.h"

namespace mha::server {
namespace {

using testing::FakeStep;
using ::testing::HasSubstr;
using testing::kNow;
using testing::Outcome;

class StepStarterTest : public ::testing::Test {
 protected:
  StepStarterTest() {
    options_.max_batch_tokens = 100;
    options_.max_batch_tokens_with_steps = 40;
  }
  // Queues a step of `tokens` on session `session` (a number); its outcome
  // is outcomes_[its index].
  FakeStep& Queue(int session, int64_t tokens) {
    outcomes_.push_back(std::make_shared<Outcome>());
    auto step = std::make_unique<FakeStep>(&sessions_[session], tokens, outcomes_.back());
    FakeStep& queued = *step;
    std::unique_ptr<Task> task = std::move(step);
    EXPECT_TRUE(lanes_.Admit(task, kNow).ok());
    return queued;
  }
  // Takes the steps at `now`: the tokens of those started, in order.
  std::vector<int64_t> Take(absl::Time now = kNow) {
    const StepStarter starter(options_, CallTokens::Resolve(options_, 1), model_);
    Mutex mu;
    MutexLock lock(mu);
    more_ = false;
    refused_.clear();
    started_ = starter.TakeSteps(lanes_, mu, now, refused_, more_);
    std::vector<int64_t> tokens;
    for (const StartedStep& s : started_) tokens.push_back(s.task->tokens());
    return tokens;
  }

  Metrics metrics_;
  ModelMetrics& model_ = metrics_.ForModel("m");
  BatcherOptions options_;
  TaskLanes lanes_{"m", options_, model_};
  int sessions_[8] = {};
  std::vector<std::shared_ptr<Outcome>> outcomes_;
  std::vector<StartedStep> started_;
  std::vector<std::unique_ptr<Task>> refused_;
  bool more_ = false;
};

TEST_F(StepStarterTest, OneStepPerSessionOldestFirst) {
  Queue(0, 1);
  Queue(0, 2);  // behind its session's first
  Queue(1, 3);
  EXPECT_EQ(Take(), (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(more_);
  ASSERT_EQ(lanes_.steps().size(), 1);
  EXPECT_EQ(lanes_.steps().front()->tokens(), 2);
  EXPECT_EQ(started_[0].task->waited, absl::ZeroDuration());
  EXPECT_EQ(outcomes_[0]->allocated, 1);  // its cache blocks
}

TEST_F(StepStarterTest, StepsFillTheCallsTokensAndTheRestWait) {
  Queue(0, 60);
  Queue(1, 50);  // 110 with the first: waits, and says so
  Queue(2, 30);
  EXPECT_EQ(Take(), (std::vector<int64_t>{60, 30}));
  EXPECT_TRUE(more_);
  EXPECT_EQ(outcomes_[1]->begun, 0);  // never asked
}

TEST_F(StepStarterTest, ChunksOfSplitRequestsShareTheCapOnAttendRows) {
  Queue(0, 30).chunk = true;
  Queue(1, 30).chunk = true;  // 60 chunk rows > the cap of 40
  Queue(2, 20);               // a session's step is not capped
  EXPECT_EQ(Take(), (std::vector<int64_t>{30, 20}));
  EXPECT_TRUE(more_);
}

TEST_F(StepStarterTest, CancelledAndExpiredStepsAreRefusedAndCounted) {
  Queue(0, 1).cancelled = true;
  Queue(1, 1).deadline = kNow - absl::Seconds(1);
  Queue(2, 1);
  EXPECT_EQ(Take(), std::vector<int64_t>{1});
  ASSERT_EQ(refused_.size(), 2);
  EXPECT_EQ(refused_[0]->refusal.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(refused_[1]->refusal.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(refused_[1]->refusal.message(), HasSubstr("while the step was queued"));
  EXPECT_EQ(outcomes_[0]->dropped, std::vector<std::string>{"cancelled"});
  EXPECT_EQ(outcomes_[1]->dropped, std::vector<std::string>{"deadline"});
  EXPECT_EQ(outcomes_[0]->begun, 0);
  EXPECT_TRUE(lanes_.steps().empty());
}

TEST_F(StepStarterTest, ABusySessionKeepsItsStepsWaitingAndARefusingOneLosesThem) {
  Queue(0, 1).start = StepTask::Start::kBusy;
  Queue(0, 2);  // behind the busy one: not asked
  Queue(1, 3).start = StepTask::Start::kRefused;
  Queue(1, 4);  // its session refused the one before, not this one
  EXPECT_EQ(Take(), std::vector<int64_t>{4});
  EXPECT_FALSE(more_);  // busy is not a lack of room
  ASSERT_EQ(refused_.size(), 1);
  EXPECT_THAT(refused_[0]->refusal.message(), HasSubstr("session refused the step"));
  EXPECT_EQ(outcomes_[1]->begun, 0);
  EXPECT_EQ(lanes_.steps().size(), 2);
}

TEST_F(StepStarterTest, AStepWaitsForMemoryBesideOthersButIsRefusedAlone) {
  MemoryBudget budget(1000);
  options_.memory = &budget;
  Queue(0, 1).active = 600;
  Queue(1, 1).active = 600;  // fits once the first is done
  EXPECT_EQ(Take(), std::vector<int64_t>{1});
  EXPECT_TRUE(more_);
  EXPECT_EQ(outcomes_[1]->abandoned, 1);  // its session given back
  EXPECT_TRUE(refused_.empty());
  // Alone in its call, with the memory held elsewhere: refused.
  started_.clear();
  MemoryReservation held;
  ASSERT_EQ(budget.TryGrowActive(500, held), MemoryBudget::Growth::kGrown);
  EXPECT_TRUE(Take().empty());
  ASSERT_EQ(refused_.size(), 1);
  EXPECT_EQ(refused_[0]->refusal.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused_[0]->refusal.message(), HasSubstr("more to compute"));
  EXPECT_EQ(outcomes_[1]->abandoned, 2);
  EXPECT_EQ(outcomes_[1]->dropped, std::vector<std::string>{"memory"});
}

TEST_F(StepStarterTest, AStepWhoseBlocksCannotBeAllocatedIsRefusedAndGivenBack) {
  Queue(0, 1).allocate = absl::ResourceExhaustedError("no cache blocks");
  EXPECT_TRUE(Take().empty());
  ASSERT_EQ(refused_.size(), 1);
  EXPECT_EQ(refused_[0]->refusal.message(), "no cache blocks");
  EXPECT_EQ(outcomes_[0]->abandoned, 1);
}

}  // namespace
}  // namespace mha::server
