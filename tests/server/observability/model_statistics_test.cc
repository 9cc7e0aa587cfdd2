// ModelStatistics (what Triton's statistics extension reports): every
// figure of an engine call added in one step, failures apart, calls without
// answers not counted.
#include "server/observability/model_statistics.h"

#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

ModelStatistics::Call CallOf(uint64_t requests, uint64_t rows, int answers) {
  ModelStatistics::Call call;
  call.batch_requests = requests;
  call.batch_rows = rows;
  call.input = absl::Microseconds(10);
  call.infer = absl::Microseconds(100);
  call.output = absl::Microseconds(5);
  for (int i = 0; i < answers; ++i) {
    call.AddAnswer(absl::Microseconds(300), absl::Microseconds(50),
                   static_cast<int64_t>(rows) / std::max(1, answers));
  }
  return call;
}

TEST(ModelStatisticsTest, ACallCountsItsAnswersInEveryStageAtOnce) {
  ModelStatistics stats;
  const uint64_t before_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  stats.Record(CallOf(/*requests=*/2, /*rows=*/4, /*answers=*/2));
  const ModelStatistics::Snapshot s = stats.Read();
  EXPECT_EQ(s.execution_count, 1u);
  EXPECT_EQ(s.inference_count, 4u);  // rows, Triton's batch_size unit
  EXPECT_GE(s.last_inference_ms, before_ms);
  for (const ModelStatistics::Duration* d :
       {&s.success, &s.queue, &s.compute_input, &s.compute_infer, &s.compute_output}) {
    EXPECT_EQ(d->count, 2u);
  }
  EXPECT_EQ(s.success.ns, 600'000u);  // two answers of 300 us
  EXPECT_EQ(s.queue.ns, 100'000u);
  EXPECT_EQ(s.compute_infer.ns, 200'000u);  // the call's time, once per answer
  ASSERT_EQ(s.batches.count(2), 1u);        // by requests per call
  EXPECT_EQ(s.batches.at(2).compute_infer.count, 1u);
  EXPECT_EQ(s.batches.at(2).compute_infer.ns, 100'000u);
  ASSERT_EQ(s.batch_sizes.count(4), 1u);  // by rows per call
  EXPECT_EQ(s.batch_sizes.at(4).compute_input.count, 1u);
  EXPECT_EQ(s.fail.count, 0u);
}

TEST(ModelStatisticsTest, CallsWithoutAnswersAndFailuresCountApart) {
  ModelStatistics stats;
  stats.Record(CallOf(1, 1, /*answers=*/0));  // every request failed: no execution
  stats.RecordFailure(absl::Milliseconds(2));
  stats.RecordFailure(absl::Milliseconds(3));
  const ModelStatistics::Snapshot s = stats.Read();
  EXPECT_EQ(s.execution_count, 0u);
  EXPECT_EQ(s.inference_count, 0u);
  EXPECT_EQ(s.success.count, 0u);
  EXPECT_TRUE(s.batches.empty());
  EXPECT_EQ(s.fail.count, 2u);
  EXPECT_EQ(s.fail.ns, 5'000'000u);
}

// Readers never see a call half counted: with calls recorded from several
// threads, every snapshot has success == queue == compute counts and the
// rows of batch_sizes sum to inference_count.
TEST(ModelStatisticsTest, ConcurrentReadersSeeWholeCalls) {
  ModelStatistics stats;
  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&stats, t] {
      for (int i = 0; i < 2000; ++i) stats.Record(CallOf(1 + t, 2 * (1 + t), 1 + t));
    });
  }
  for (int r = 0; r < 500; ++r) {
    const ModelStatistics::Snapshot s = stats.Read();
    ASSERT_EQ(s.success.count, s.queue.count);
    ASSERT_EQ(s.success.count, s.compute_infer.count);
    uint64_t rows = 0, executions = 0;
    for (const auto& [size, stages] : s.batch_sizes) {
      rows += size * stages.compute_infer.count;
      executions += stages.compute_infer.count;
    }
    ASSERT_EQ(rows, s.inference_count);
    ASSERT_EQ(executions, s.execution_count);
  }
  for (std::thread& w : writers) w.join();
  EXPECT_EQ(stats.Read().execution_count, 6000u);
}

}  // namespace
}  // namespace mha::server
