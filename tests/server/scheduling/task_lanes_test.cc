// TaskLanes: admission (the queue's count and byte limits, the memory
// budget), the priority levels, the lanes' counts and depth, and the ways
// tasks leave.
#include "server/scheduling/task_lanes.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/observability/metrics.h"
#include "tests/server/attend_requests.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/fake_tasks.h"

namespace mha::server {
namespace {

using testing::FakeProjection;
using testing::FakeStep;
using ::testing::HasSubstr;
using testing::kNow;
using testing::Outcome;

std::unique_ptr<Task> AttendOf(int64_t len, uint64_t priority = 0, uint32_t seed = 1) {
  auto call = testing::MakeCall(DecodeOwned(Request(len, seed)), [](auto) {});
  call->priority = priority;
  return call;
}

class TaskLanesTest : public ::testing::Test {
 protected:
  std::unique_ptr<Task> Step(const void* session, int64_t wire_bytes = 0) {
    auto step = std::make_unique<FakeStep>(session, 1, outcome_);
    step->wire_bytes = wire_bytes;
    step->queued_bytes = wire_bytes;
    return step;
  }
  double Dropped(const std::string& reason) { return model_.dropped.at(reason)->Value(); }

  Metrics metrics_;
  ModelMetrics& model_ = metrics_.ForModel("m");
  std::shared_ptr<Outcome> outcome_ = std::make_shared<Outcome>();
  BatcherOptions options_;
};

TEST_F(TaskLanesTest, RefusesPastTheQueuesCountNamingItsLimit) {
  options_.max_queue_size = 2;
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> a = AttendOf(4), b = Step(this), c = AttendOf(4);
  EXPECT_TRUE(lanes.Admit(a, kNow).ok());
  EXPECT_TRUE(lanes.Admit(b, kNow).ok());
  EXPECT_EQ(a, nullptr);  // taken
  const absl::Status full = lanes.Admit(c, kNow);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("model 'm': queue full (2 requests waiting)"));
  ASSERT_NE(c, nullptr);  // left with the caller, to answer
  EXPECT_EQ(Dropped("queue_full"), 1);
  EXPECT_EQ(lanes.size(), 2);
}

TEST_F(TaskLanesTest, RefusesPastTheQueuesBytesNamingThem) {
  options_.max_queue_bytes = 100;
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> first = Step(this, 60), second = Step(&lanes, 60);
  EXPECT_TRUE(lanes.Admit(first, kNow).ok());
  const absl::Status full = lanes.Admit(second, kNow);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("queue full (60 bytes waiting, this step 60, limit 100)"));
  EXPECT_EQ(outcome_->dropped, std::vector<std::string>{"queue_full"});  // a step's own count
}

TEST_F(TaskLanesTest, RefusesWhatTheMemoryBudgetCannotHold) {
  MemoryBudget budget(1000);
  options_.memory = &budget;
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> held = Step(this, 600), more = Step(&lanes, 600);
  ASSERT_TRUE(lanes.Admit(held, kNow).ok());
  EXPECT_EQ(budget.reserved(), 600);
  const absl::Status full = lanes.Admit(more, kNow);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("to wait in the queue"));
  EXPECT_EQ(budget.reserved(), 600);  // nothing of the refused one
  std::unique_ptr<Task> huge = Step(this, 5000);
  EXPECT_EQ(lanes.Admit(huge, kNow).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(outcome_->dropped, (std::vector<std::string>{"memory", "memory"}));
}

TEST_F(TaskLanesTest, QueuesRequestsByPriorityLevelOldestFirstWithin) {
  options_.priority_levels = 3;
  options_.default_priority_level = 2;
  TaskLanes lanes("m", options_, model_);
  // Levels asked: 3, 0 (the default, 2), 1, 9 (above the levels: the
  // default), 1. Each request's length names it.
  for (auto [len, priority] :
       std::vector<std::pair<int64_t, uint64_t>>{{3, 3}, {4, 0}, {5, 1}, {6, 9}, {7, 1}}) {
    std::unique_ptr<Task> r = AttendOf(len, priority);
    ASSERT_TRUE(lanes.Admit(r, kNow).ok());
  }
  std::vector<int64_t> order;
  std::vector<uint64_t> levels;
  for (const auto& r : lanes.requests()) {
    order.push_back(r->input().q_len());
    levels.push_back(r->priority);
  }
  EXPECT_EQ(order, (std::vector<int64_t>{5, 7, 4, 6, 3}));
  EXPECT_EQ(levels, (std::vector<uint64_t>{1, 1, 2, 2, 3}));
}

TEST_F(TaskLanesTest, CountsTokensAndDepthAsTasksComeAndGo) {
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> a = AttendOf(4), b = AttendOf(6), s = Step(this);
  std::unique_ptr<Task> p = std::make_unique<FakeProjection>(outcome_);
  for (auto* t : {&a, &b, &s, &p}) ASSERT_TRUE(lanes.Admit(*t, kNow).ok());
  EXPECT_EQ(lanes.queued_tokens(), 2 * (4 + 6));  // query + key tokens
  EXPECT_EQ(model_.queue_depth->Value(), 4);
  EXPECT_EQ(lanes.requests().front()->enqueued, kNow);
  std::unique_ptr<AttendCall> taken = lanes.TakeRequest(1);
  EXPECT_EQ(taken->input().q_len(), 6);
  EXPECT_EQ(lanes.queued_tokens(), 8);
  EXPECT_EQ(lanes.TakeProjections().size(), 1);
  EXPECT_FALSE(lanes.has_projections());
  EXPECT_EQ(model_.queue_depth->Value(), 2);
  lanes.TakeStep(0, /*refused=*/false);
  lanes.TakeRequest(0);
  EXPECT_TRUE(lanes.empty());
  EXPECT_EQ(lanes.queued_tokens(), 0);
  EXPECT_EQ(model_.queue_depth->Value(), 0);
}

TEST_F(TaskLanesTest, TasksLeavingUnansweredByACallMarkTheirMemoryLeaving) {
  MemoryBudget budget(1000);
  options_.memory = &budget;
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> step = Step(this, 100),
                        projection = std::make_unique<FakeProjection>(outcome_);
  projection->queued_bytes = 200;
  ASSERT_TRUE(lanes.Admit(step, kNow).ok());
  ASSERT_TRUE(lanes.Admit(projection, kNow).ok());
  EXPECT_EQ(budget.active(), 0);
  auto projections = lanes.TakeProjections();
  EXPECT_EQ(budget.active(), 200);  // comes back by itself once it ran
  std::unique_ptr<StepTask> refused = lanes.TakeStep(0, /*refused=*/true);
  EXPECT_EQ(budget.active(), 300);
  refused.reset();
  projections.clear();
  EXPECT_EQ(budget.reserved(), 0);
}

TEST_F(TaskLanesTest, StepsAreReadyWhenQueuedOrMarkedAndTheTakerClearsIt) {
  TaskLanes lanes("m", options_, model_);
  EXPECT_FALSE(lanes.MarkStepsReady());  // no step waits
  EXPECT_FALSE(lanes.steps_ready());
  std::unique_ptr<Task> s = Step(this);
  ASSERT_TRUE(lanes.Admit(s, kNow).ok());
  EXPECT_TRUE(lanes.steps_ready());
  EXPECT_TRUE(lanes.TakeStepsReady());
  EXPECT_FALSE(lanes.steps_ready());
  EXPECT_TRUE(lanes.MarkStepsReady());
  EXPECT_TRUE(lanes.TakeStepsReady());
  std::vector<std::unique_ptr<StepTask>> chunks;
  chunks.push_back(std::make_unique<FakeStep>(this, 2, outcome_));
  lanes.AddChunks(chunks, kNow + absl::Seconds(1));
  EXPECT_TRUE(lanes.steps_ready());
  EXPECT_EQ(lanes.steps().size(), 2);
  EXPECT_EQ(lanes.steps().back()->enqueued, kNow + absl::Seconds(1));
}

TEST_F(TaskLanesTest, ASplitThatThrowsLeavesTheOldestRequestFirst) {
  TaskLanes lanes("m", options_, model_);
  std::unique_ptr<Task> a = AttendOf(4), b = AttendOf(5);
  ASSERT_TRUE(lanes.Admit(a, kNow).ok());
  ASSERT_TRUE(lanes.Admit(b, kNow).ok());
  EXPECT_THROW(
      lanes.SplitOldest([](std::unique_ptr<AttendCall>&) -> std::unique_ptr<ProjectionTask> {
        throw std::bad_alloc();
      }),
      std::bad_alloc);
  EXPECT_EQ(lanes.requests().size(), 2);
  EXPECT_EQ(lanes.requests().front()->input().q_len(), 4);
  std::unique_ptr<AttendCall> kept;
  auto task = lanes.SplitOldest([&](std::unique_ptr<AttendCall>& oldest) {
    kept = std::move(oldest);
    return std::make_unique<FakeProjection>(outcome_);
  });
  EXPECT_NE(task, nullptr);
  EXPECT_EQ(kept->input().q_len(), 4);
  EXPECT_EQ(lanes.requests().size(), 1);
  EXPECT_EQ(lanes.queued_tokens(), 10);
  EXPECT_EQ(model_.queue_depth->Value(), 1);
}

}  // namespace
}  // namespace mha::server
