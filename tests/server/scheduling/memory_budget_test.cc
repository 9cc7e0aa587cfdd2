// The memory budget (server/scheduling/memory_budget.h), the batcher forming batches
// within it, and admission by bytes (server/scheduling/admission.h).
#include "server/scheduling/memory_budget.h"

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "engine/mha_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/frontends/common/request_codec.h"
#include "server/scheduling/admission.h"
#include "server/scheduling/batcher.h"
#include "tests/engine/test_models.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kEmbed = 24;

AttentionDims Dims() { return testing::MakeDims(kEmbed, 3); }

// A decoded self-attention request of one sequence of `len` tokens.
AttentionRequest Decoded(int64_t len, uint32_t seed, bool need_weights = false) {
  auto owned = std::make_shared<v1::AttendRequest>();  // the request's views point into it
  v1::AttendRequest& r = *owned;
  v1::Tensor* q = r.mutable_query();
  q->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {int64_t{1}, len, kEmbed}) q->add_shape(d);
  const std::vector<float> values = testing::RandomVector(len * kEmbed, seed);
  q->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  r.set_need_weights(need_weights);
  AttentionRequest decoded = DecodeAttendRequest(r, Dims(), {}).value();
  decoded.KeepAlive(std::move(owned));
  return decoded;
}

TEST(MemoryBudgetTest, ReservationsStayWithinCapacityAndComeBack) {
  MemoryBudget budget(1000);
  budget.SetReserve(200);
  EXPECT_EQ(budget.capacity(), 800);
  MemoryReservation a, b;
  EXPECT_TRUE(budget.TryReserveQueued(300, a));
  EXPECT_EQ(budget.TryGrowActive(501, a), MemoryBudget::Growth::kFull);  // only queued bytes held
  EXPECT_EQ(a.bytes(), 300);
  EXPECT_EQ(budget.TryGrowActive(400, a), MemoryBudget::Growth::kGrown);
  EXPECT_EQ(budget.reserved(), 700);
  EXPECT_EQ(budget.active(), 400);
  EXPECT_FALSE(budget.TryReserveQueued(101, b));  // would pass 800
  EXPECT_EQ(b.bytes(), 0);
  EXPECT_TRUE(budget.TryReserveQueued(100, b));
  // Full, but a's active bytes will come back: worth waiting for.
  EXPECT_EQ(budget.TryGrowActive(1, b), MemoryBudget::Growth::kFullUntilActiveReturns);
  {
    MemoryReservation moved = std::move(a);  // the bytes move with it
    EXPECT_EQ(moved.bytes(), 700);
    EXPECT_EQ(budget.reserved(), 800);
  }
  EXPECT_EQ(budget.reserved(), 100);
  EXPECT_EQ(budget.active(), 0);
  EXPECT_EQ(budget.TryGrowActive(701, b), MemoryBudget::Growth::kFull);
  budget.MarkLeaving(b);  // b's request was refused: its bytes come back by themselves
  EXPECT_EQ(budget.reserved(), 100);
  EXPECT_EQ(budget.active(), 100);
  MemoryReservation c;
  EXPECT_TRUE(budget.TryReserveQueued(100, c));
  EXPECT_EQ(budget.TryGrowActive(601, c), MemoryBudget::Growth::kFullUntilActiveReturns);
  c.Release();
  b.Release();
  EXPECT_EQ(budget.reserved(), 0);
}

TEST(MemoryBudgetTest, LimitFromTheFlagOrSeventyFivePercentOfWhatTheMachineHas) {
  EXPECT_EQ(ResolveMemoryLimit(12345).bytes, 12345);
  const MemoryLimit automatic = ResolveMemoryLimit(0);
  EXPECT_GT(automatic.bytes, 0);
  EXPECT_THAT(automatic.source, HasSubstr("75% of "));
  EXPECT_EQ(WithCommas(1073741824), "1,073,741,824");
  EXPECT_EQ(WithCommas(999), "999");
}

TEST(AdmissionTest, ResponseAboveTheMessageLimitNamesTheNumbers) {
  auto engine = MhaEngine::Create(Dims(), testing::RandomWeights(Dims(), 3)).value();
  const AttentionRequest r = Decoded(1000, 1, /*need_weights=*/true);
  const RequestCost cost = CostOf(r, *engine, 1);
  // Output [1, 1000, 24] and weights [1, 1000, 1000], FP32, and framing.
  EXPECT_GE(cost.response_bytes, (1000 * 24 + 1000 * 1000) * 4);
  EXPECT_LE(cost.response_bytes, (1000 * 24 + 1000 * 1000) * 4 + 4096);
  EXPECT_TRUE(CheckResponseSize(r, cost, 8 << 20).ok());
  const absl::Status refused = CheckResponseSize(r, cost, 1 << 20);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(),
              HasSubstr("attn_weights would be 4,000,000 bytes ([1, 1000, 1000] FP32); the "
                        "limit is 1,048,576 (--max_message_bytes): ask without need_weights"));
  EXPECT_TRUE(CheckWorkingMemory(r, cost, cost.total()).ok());
  EXPECT_THAT(CheckWorkingMemory(r, cost, cost.total() - 1).message(),
              HasSubstr("bytes of working memory"));
}

class BudgetedBatcherTest : public ::testing::Test {
 protected:
  BudgetedBatcherTest()
      : engine_(MhaEngine::Create(Dims(), testing::RandomWeights(Dims(), 3)).value()) {}

  // Enqueues a request holding `queued` bytes while it waits and needing
  // `active` more to compute.
  // The outcome only: the result's views live during `done`.
  std::future<absl::Status> Submit(Batcher& b, int64_t queued, int64_t active, uint32_t seed) {
    auto promise = std::make_shared<std::promise<absl::Status>>();
    auto p = testing::MakeCall(Decoded(8, seed), [promise](absl::StatusOr<AttentionResult> result) {
      promise->set_value(result.status());
    });
    p->queued_bytes = queued;
    p->active_bytes = active;
    b.Enqueue(std::move(p));  // a refusal comes through Fail, at once
    return promise->get_future();
  }

  double Batches() {
    return metrics_.ForModel("m").batch_requests->Collect().histogram.sample_count;
  }

  std::unique_ptr<MhaEngine> engine_;
  Metrics metrics_;
  testing::ManualClock clock_;
};

// Requests that would share one batch by tokens and time run one per batch
// when the budget holds one at a time; two workers wait for each other.
TEST_F(BudgetedBatcherTest, BatchesAreFormedWithinTheBudget) {
  MemoryBudget budget(1500);
  BatcherOptions options;
  options.memory = &budget;
  options.workers = 2;
  options.compute_threads = 1;
  options.max_queue_delay = absl::Milliseconds(100);
  options.clock = &clock_;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  std::vector<std::future<absl::Status>> results;
  for (uint32_t i = 0; i < 4; ++i) results.push_back(Submit(batcher, 100, 1000, i));
  clock_.Advance(absl::Milliseconds(100));
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  batcher.Stop();
  EXPECT_EQ(Batches(), 4);
  EXPECT_EQ(budget.reserved(), 0);
}

// Queued bytes are reserved at Enqueue (refused when they do not fit); a
// request whose compute memory cannot be had while nothing computing will
// give any back (other queued requests hold it) is refused, not left to
// wait forever; the others are answered.
TEST_F(BudgetedBatcherTest, RequestThatNothingWillMakeRoomForIsRefused) {
  MemoryBudget budget(1000);
  BatcherOptions options;
  options.memory = &budget;
  options.max_queue_delay = absl::Milliseconds(100);
  options.clock = &clock_;
  Batcher batcher("m", *engine_, options, metrics_.ForModel("m"));
  auto a = Submit(batcher, 100, 100, 1);
  auto b = Submit(batcher, 500, 450, 2);  // 950 alone, but c's queued bytes stay
  auto c = Submit(batcher, 300, 50, 3);
  auto d = Submit(batcher, 200, 10, 4);  // 900 queued already: does not fit
  const absl::Status at_enqueue = d.get();
  EXPECT_EQ(at_enqueue.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(at_enqueue.message(), HasSubstr("to wait in the queue"));
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_TRUE(a.get().ok());
  const absl::Status at_batch = b.get();
  EXPECT_EQ(at_batch.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(at_batch.message(), HasSubstr("more to compute"));
  EXPECT_TRUE(c.get().ok());
  batcher.Stop();
  EXPECT_EQ(budget.reserved(), 0);
  const auto dropped = metrics_.registry()->Collect();
  double memory_drops = 0;
  for (const auto& family : dropped) {
    if (family.name != "mha_dropped_requests_total") continue;
    for (const auto& metric : family.metric) {
      for (const auto& label : metric.label) {
        if (label.name == "reason" && label.value == "memory") memory_drops += metric.counter.value;
      }
    }
  }
  EXPECT_EQ(memory_drops, 2);
}

}  // namespace
}  // namespace mha::server
