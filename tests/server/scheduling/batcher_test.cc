// The batcher on a real engine: calls formed from concurrent requests,
// limits, priorities and drops.
#include "tests/server/scheduling/batcher_fixture.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

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

}  // namespace
}  // namespace mha::server
