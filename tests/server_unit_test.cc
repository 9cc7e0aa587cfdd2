// The server's parts without gRPC: request decoding, batch merging and the
// batcher, on a real engine.
#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "engine/wire_dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/frontends/request_codec.h"
#include "server/scheduling/batcher.h"
#include "server/scheduling/task.h"
#include "tests/callback_call.h"
#include "tests/manual_clock.h"
#include "tests/test_models.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

AttentionDims Dims() { return testing::MakeDims(24, 3); }

v1::Tensor Wire(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FP32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  return t;
}

v1::Tensor BoolWire(const std::vector<int64_t>& shape, const std::vector<uint8_t>& values) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_BOOL);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::string(values.begin(), values.end()));
  return t;
}

// A self-attention request of one sequence of `len` tokens.
v1::AttendRequest Request(int64_t len, uint32_t seed, bool key_padding = false) {
  v1::AttendRequest r;
  r.set_model("m");
  *r.mutable_query() = Wire({1, len, 24}, testing::RandomVector(len * 24, seed));
  if (key_padding) {
    std::vector<uint8_t> mask(len, 0);
    mask[0] = 1;
    *r.mutable_key_padding_mask() = BoolWire({1, len}, mask);
  }
  return r;
}

absl::Status DecodeError(const v1::AttendRequest& r) {
  return DecodeAttendRequest(r, Dims(), RequestLimits{}).status();
}

// A call whose encoding may run out of memory, counting its answers.
class CountingCall final : public AttendCall {
 public:
  explicit CountingCall(bool encode_throws) : encode_throws_(encode_throws) {}
  std::vector<absl::Status> answers;
  int encoded = 0;
  absl::Status encode_error;  // what Encode answers when it does not throw

 private:
  absl::Status Encode(const AttentionResult&) override {
    ++encoded;
    if (encode_throws_) throw std::bad_alloc();
    return encode_error;
  }
  void Finish(const absl::Status& status) override { answers.push_back(status); }
  const bool encode_throws_;
};

// Whoever comes first answers; a call is never answered twice, never with
// an OK failure, and a response that cannot be encoded is an error.
TEST(AttendCallTest, AnswersExactlyOnce) {
  CountingCall failed(false);
  failed.Fail(absl::DeadlineExceededError("late"));
  failed.Respond({});
  failed.Fail(absl::CancelledError("gone"));
  ASSERT_EQ(failed.answers.size(), 1u);
  EXPECT_EQ(failed.answers[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(failed.encoded, 0);

  CountingCall answered(false);
  answered.Respond({});
  answered.Fail(absl::CancelledError("gone"));
  ASSERT_EQ(answered.answers.size(), 1u);
  EXPECT_TRUE(answered.answers[0].ok());
  EXPECT_TRUE(answered.answered());

  CountingCall no_memory(true);
  no_memory.Respond({});
  ASSERT_EQ(no_memory.answers.size(), 1u);
  EXPECT_EQ(no_memory.answers[0].code(), absl::StatusCode::kResourceExhausted);

  CountingCall unwritable(false);  // e.g. a shared-memory output it cannot write
  unwritable.encode_error = absl::InvalidArgumentError("region gone");
  unwritable.Respond({});
  ASSERT_EQ(unwritable.answers.size(), 1u);
  EXPECT_EQ(unwritable.answers[0].code(), absl::StatusCode::kInvalidArgument);

  CountingCall ok_failure(false);
  ok_failure.Fail(absl::OkStatus());
  ASSERT_EQ(ok_failure.answers.size(), 1u);
  EXPECT_FALSE(ok_failure.answers[0].ok()) << "a failure is never OK";
}

TEST(RequestCodecTest, DecodesAValidRequestAsViewsOfItsBytes) {
  const v1::AttendRequest request = Request(5, 1, true);
  absl::StatusOr<AttentionRequest> d = DecodeAttendRequest(request, Dims(), {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kind(), AttentionKind::kSelf);
  EXPECT_EQ(d->tokens(), 10);
  EXPECT_EQ(d->output_shape(), (std::vector<int64_t>{1, 5, 24}));
  EXPECT_EQ(d->output_dtype(), DType::kF32);
  EXPECT_TRUE(d->batch().key_padding_mask.present());
  EXPECT_EQ(static_cast<const void*>(d->batch().query.data()), request.query().data().data());
  EXPECT_EQ(d->batch().key_padding_mask.data, request.key_padding_mask().data().data());
}

TEST(RequestCodecTest, RejectsEachMalformedFieldWithItsName) {
  struct Case {
    const char* what;
    std::function<void(v1::AttendRequest&)> edit;
    absl::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no query", [](auto& r) { r.clear_query(); }, absl::StatusCode::kInvalidArgument,
       "query: required"},
      {"bytes", [](auto& r) { r.mutable_query()->mutable_data()->pop_back(); },
       absl::StatusCode::kInvalidArgument, "query: data has 479 bytes"},
      {"last dim",
       [](auto& r) {
         *r.mutable_query() = Wire({1, 6, 20}, std::vector<float>(120));
       },
       absl::StatusCode::kInvalidArgument, "query: expected last dimension 24, got 20"},
      {"rank", [](auto& r) { *r.mutable_query() = Wire({120}, std::vector<float>(120)); },
       absl::StatusCode::kInvalidArgument, "query: expected rank 3"},
      {"negative", [](auto& r) { r.mutable_query()->set_shape(1, -5); },
       absl::StatusCode::kInvalidArgument, "query: negative dimension"},
      {"overflow",
       [](auto& r) {
         r.mutable_query()->clear_shape();
         for (int64_t d : {int64_t{1} << 40, int64_t{1} << 40, int64_t{24}})
           r.mutable_query()->add_shape(d);
       },
       absl::StatusCode::kInvalidArgument, "overflows int64"},
      {"dtype", [](auto& r) { r.mutable_query()->set_dtype(static_cast<v1::DataType>(99)); },
       absl::StatusCode::kInvalidArgument, "query: dtype 99"},
      {"bool query",
       [](auto& r) {
         *r.mutable_query() = BoolWire({1, 2, 24}, std::vector<uint8_t>(48));
       },
       absl::StatusCode::kInvalidArgument, "query: dtype DATA_TYPE_BOOL"},
      {"nan",
       [](auto& r) {
         float nan = std::numeric_limits<float>::quiet_NaN();
         std::memcpy(r.mutable_query()->mutable_data()->data() + 8, &nan, 4);
       },
       absl::StatusCode::kInvalidArgument, "query: element 2 is nan"},
      {"value without key", [](auto& r) { *r.mutable_value() = r.query(); },
       absl::StatusCode::kInvalidArgument, "value: given without key"},
      {"empty key",  // would read as self-attention (found by fuzz_request)
       [](auto& r) {
         *r.mutable_key() = Wire({1, 0, 24}, {});
         *r.mutable_value() = Wire({1, 0, 24}, {});
       },
       absl::StatusCode::kInvalidArgument, "key: shape [1, 0, 24] has no tokens"},
      {"mask shape",
       [](auto& r) {
         *r.mutable_key_padding_mask() = BoolWire({1, 4}, {0, 0, 0, 0});
       },
       absl::StatusCode::kInvalidArgument, "key_padding_mask: expected shape [1, 5]"},
      {"mask dtype",
       [](auto& r) {
         *r.mutable_attn_mask() = Wire({5, 5}, std::vector<float>(25));
         r.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
       },
       absl::StatusCode::kInvalidArgument, "attn_mask: dtype DATA_TYPE_UNSPECIFIED is not one of"},
      {"attn mask shape",
       [](auto& r) {
         *r.mutable_attn_mask() = BoolWire({5, 4}, std::vector<uint8_t>(20));
       },
       absl::StatusCode::kInvalidArgument, "attn_mask: expected shape [5, 5] or [3, 5, 5]"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest r = Request(5, 2);
    c.edit(r);
    const absl::Status s = DecodeError(r);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.what;
  }
}

TEST(RequestCodecTest, TooManyTokensIsResourceExhausted) {
  const v1::AttendRequest request = Request(8, 1);
  absl::StatusOr<AttentionRequest> d =
      DecodeAttendRequest(request, Dims(), RequestLimits{.max_tokens = 10});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RequestCodecTest, EncodesHalfTypesThatDecodeBack) {
  const std::vector<float> values = {1.0f, -2.5f, 0.333f, 65504.0f, 1e-6f, 0.0f};
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    v1::Tensor wire;
    EncodeTensor(values, {6}, dtype, &wire);
    EXPECT_EQ(wire.dtype(), ToWireDType(dtype));
    ASSERT_EQ(wire.data().size(), 12u);
    std::vector<float> got(6);
    ConvertToFloat(dtype, reinterpret_cast<const uint8_t*>(wire.data().data()), 6, got.data());
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_NEAR(got[i], values[i], std::fabs(values[i]) * 1e-2 + 1e-7)
          << i << " " << DTypeName(dtype);
    }
  }
}

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
    plan.step = AppendStep{&cache_, tokens_, false};
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

  // The decoded request, keeping a copy of the message its views point into.
  AttentionRequest Decode(const v1::AttendRequest& r) {
    auto owned = std::make_shared<v1::AttendRequest>(r);
    AttentionRequest d = DecodeAttendRequest(*owned, Dims(), {}).value();
    d.KeepAlive(std::move(owned));
    return d;
  }

  // The answer of one request computed alone.
  std::vector<float> Alone(const v1::AttendRequest& r) {
    AttentionRequest d = Decode(r);
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
        Decode(r),
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
  BatcherOptions options = Delayed(absl::Seconds(30));
  options.max_batch_tokens = 1 << 20;
  options.max_batch_tokens_with_steps = 100;
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
    auto call =
        testing::MakeCall(Decode(Request(20, seed)), [&, name](absl::StatusOr<AttentionResult> r) {
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
  BatcherOptions options = Delayed(absl::Seconds(30));
  options.max_batch_tokens = 1 << 20;
  options.max_batch_tokens_with_steps = 100;
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
// most for the call in progress, then rides in the next one (capped). Its
// steps are refused, like Attend requests, when their deadline passed or
// their caller cancelled, before anything is computed.
TEST_F(BatcherTest, AStepWaitsAtMostOneCappedCall) {
  BatcherOptions options = Delayed(absl::Seconds(30));
  options.max_batch_tokens = 1 << 20;
  options.max_batch_tokens_with_steps = 100;
  Metrics metrics;
  Batcher batcher("m", *engine_, options, metrics.ForModel("m"));
  ASSERT_TRUE(Step(batcher, metrics).get().ok());  // sessions step: the cap holds
  std::vector<std::future<absl::StatusOr<Answer>>> results;
  for (int i = 0; i < 20; ++i) results.push_back(Submit(batcher, Request(20, i)));
  const double calls_before =
      metrics.ForModel("m").compute_duration->Collect().histogram.sample_count;
  std::shared_ptr<double> calls_at_answer;
  std::future<absl::Status> answer = Step(batcher, metrics, 1, &calls_at_answer);
  ASSERT_TRUE(answer.get().ok());
  // The call computing when it arrived, then its own.
  EXPECT_LE(*calls_at_answer, calls_before + 2);
  batcher.Stop();
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  // 20 requests, two per capped call; the two steps rode along or alone.
  EXPECT_EQ(metrics.ForModel("m").batch_requests->Collect().histogram.sample_count, 10);
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
  auto holder = std::make_unique<TestStep>(*engine_, 1, zero);
  holder->gate = open_gate.get_future().share();
  holder->finishing = &finishing;
  std::future<absl::Status> held = holder->answer();
  batcher.Enqueue(std::move(holder));
  finishing.get_future().wait();
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
    auto holder = std::make_unique<TestStep>(*c.engine, 1, [] { return 0.0; });
    holder->gate = open_gate.get_future().share();
    holder->finishing = &finishing;
    std::future<absl::Status> held = holder->answer();
    batcher.Enqueue(std::move(holder));
    finishing.get_future().wait();
    int request_at = 0;
    std::promise<absl::StatusOr<Answer>> long_answer;
    batcher.Enqueue(testing::MakeCall(Decode(c.request), [&](absl::StatusOr<AttentionResult> r) {
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
    AttentionRequest alone = Decode(c.request);
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

// A queue that hands out `pending` works, each logging its name (and with
// `log_threads`, "/" and the threads the pool gave it) when it runs, after
// `gate` opens (when set).
class ScriptedQueue final : public PoolQueue {
 public:
  ScriptedQueue(std::string name, std::vector<std::string>& log, std::mutex& log_mu,
                bool log_threads = false)
      : name_(std::move(name)), log_(log), log_mu_(log_mu), log_threads_(log_threads) {}
  // Works run after `gate` opens; `started` is set when one begins.
  void Add(int works, std::shared_future<void> gate = {}, std::promise<void>* started = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ += works;
    gate_ = std::move(gate);
    started_ = started;
  }
  std::unique_ptr<PoolWork> Poll(Idle&) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ == 0) return nullptr;
    --pending_;
    return std::make_unique<Logged>(*this, gate_, std::exchange(started_, nullptr));
  }

 private:
  struct Logged final : PoolWork {
    Logged(ScriptedQueue& q, std::shared_future<void> g, std::promise<void>* s)
        : queue(q), gate(std::move(g)), started(s) {}
    void Run(Workspace&) override {
      if (started != nullptr) started->set_value();
      if (gate.valid()) gate.wait();
      std::lock_guard<std::mutex> lock(queue.log_mu_);
      queue.log_.push_back(queue.log_threads_
                               ? absl::StrCat(queue.name_, "/", WorkerPool::ThreadsOfThisCall())
                               : queue.name_);
    }
    ScriptedQueue& queue;
    std::shared_future<void> gate;
    std::promise<void>* started;
  };
  const std::string name_;
  std::vector<std::string>& log_;
  std::mutex& log_mu_;
  const bool log_threads_;
  std::mutex mu_;
  int pending_ = 0;
  std::shared_future<void> gate_;
  std::promise<void>* started_ = nullptr;
};

TEST(WorkerPoolTest, QueuesWokenForStepsGoFirstThenRoundRobin) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue busy("busy", log, log_mu), attend("attend", log, log_mu),
      other("other", log, log_mu), steps("steps", log, log_mu);
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  auto* busy_r = pool.Attach(&busy);
  auto* attend_r = pool.Attach(&attend);
  auto* other_r = pool.Attach(&other);
  auto* steps_r = pool.Attach(&steps);
  std::promise<void> open, started;
  busy.Add(1, open.get_future().share(), &started);
  pool.Wake(busy_r);
  started.get_future().wait();  // the one worker is in it
  attend.Add(2);
  other.Add(2);
  steps.Add(1);
  pool.Wake(attend_r);
  pool.Wake(other_r);
  pool.Wake(steps_r, /*steps=*/true);
  EXPECT_TRUE(pool.StepsRecently());
  open.set_value();
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard<std::mutex> lock(log_mu);
      if (log.size() == 6) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto* r : {busy_r, attend_r, other_r, steps_r}) pool.Detach(r);
  // Round-robin after the steps: attend, other, attend, other (no queue
  // takes two turns while another waits).
  EXPECT_THAT(log, ::testing::ElementsAre("busy", "steps", "attend", "other", "attend", "other"));
}

// With --intra_op_threads=0, a call gets the cores no other call holds: all
// of them when it starts alone, its share (cores / workers) when it starts
// beside another; a set --intra_op_threads is every call's.
TEST(WorkerPoolTest, ACallAloneGetsAllCoresACallBesideAnotherItsShare) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue first("first", log, log_mu, /*log_threads=*/true),
      second("second", log, log_mu, /*log_threads=*/true);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .cores = 4});
  EXPECT_EQ(pool.MaxThreadsPerCall(), 4);
  EXPECT_THAT(pool.CallThreadCounts(), ::testing::ElementsAre(2, 4));
  auto* first_r = pool.Attach(&first);
  auto* second_r = pool.Attach(&second);
  std::promise<void> open, started;
  first.Add(1, open.get_future().share(), &started);
  pool.Wake(first_r);
  started.get_future().wait();  // one worker is in it
  second.Add(1);
  pool.Wake(second_r);
  auto wait_for_log = [&](size_t entries) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> lock(log_mu);
        if (log.size() >= entries) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  wait_for_log(1);  // the second ran beside the first (which waits for the gate)
  open.set_value();
  wait_for_log(2);
  pool.Detach(first_r);  // returns once the first call is over
  second.Add(1);         // alone again
  pool.Wake(second_r);
  wait_for_log(3);
  pool.Detach(second_r);
  EXPECT_THAT(log, ::testing::ElementsAre("second/2", "first/4", "second/4"));

  WorkerPool fixed(WorkerPoolOptions{.workers = 2, .compute_threads = 3, .cores = 4});
  EXPECT_EQ(fixed.MaxThreadsPerCall(), 3);
  EXPECT_THAT(fixed.CallThreadCounts(), ::testing::ElementsAre(3));
}

}  // namespace
}  // namespace mha::server
