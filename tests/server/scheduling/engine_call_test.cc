// EngineCallRunner on a real engine, with no queue or worker pool: what it
// drops before compute, what each request's answer holds (large FP16
// outputs converted in the pass that checks them), steps in a call of their
// own first, projections, and what a call records.
#include "server/scheduling/engine_call.h"

#include "engine/dtype.h"
#include "engine/tensor.h"
#include "tests/server/scheduling/batcher_fixture.h"
#include "tests/server/scheduling/fake_tasks.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

// A suite of its own (gtest wants one fixture class per suite).
class EngineCallTest : public BatcherTest {
 protected:
  // A request queued now, whose answer comes through the future.
  std::unique_ptr<AttendCall> Call(const v1::AttendRequest& r,
                                   std::future<absl::StatusOr<Answer>>& answer,
                                   std::function<bool()> cancelled = {}) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<Answer>>>();
    answer = promise->get_future();
    auto call = testing::MakeCall(
        DecodeOwned(r),
        [promise](absl::StatusOr<AttentionResult> res) { promise->set_value(Keep(res)); },
        std::move(cancelled));
    call->enqueued = clock_.Now();
    call->statistics = &statistics_;  // where its answer is counted
    return call;
  }
  double Dropped(const std::string& reason) {
    return metrics_.ForModel("m").dropped.at(reason)->Value();
  }

  ModelStatistics statistics_;
  EngineCallRunner runner_{*engine_, metrics_.ForModel("m"), clock_, &statistics_};
};

TEST_F(EngineCallTest, RefusedExpiredAndCancelledRequestsAreAnsweredBeforeCompute) {
  std::future<absl::StatusOr<Answer>> refused, expired, cancelled, live;
  std::vector<std::unique_ptr<AttendCall>> batch;
  batch.push_back(Call(Request(4, 1), refused));
  batch.back()->refusal = absl::ResourceExhaustedError("no memory");
  batch.push_back(Call(Request(4, 2), expired));
  batch.back()->deadline = clock_.Now() + absl::Milliseconds(5);
  batch.push_back(Call(Request(4, 3), cancelled, [] { return true; }));
  batch.push_back(Call(Request(4, 4), live));
  clock_.Advance(absl::Milliseconds(10));
  std::vector<std::unique_ptr<AttendCall>> kept = runner_.DropUnwanted(std::move(batch));
  ASSERT_EQ(kept.size(), 1);
  EXPECT_EQ(kept[0]->waited, absl::Milliseconds(10));
  EXPECT_EQ(refused.get().status().message(), "no memory");
  EXPECT_EQ(expired.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Dropped("memory"), 1);
  EXPECT_EQ(Dropped("deadline"), 1);
  EXPECT_EQ(Dropped("cancelled"), 1);
  EXPECT_EQ(metrics_.ForModel("m").queue_duration->Collect().histogram.sample_count, 4);
  EXPECT_EQ(live.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
}

TEST_F(EngineCallTest, OneCallAnswersEachRequestAsIfComputedAloneAndRecordsIt) {
  std::vector<std::future<absl::StatusOr<Answer>>> answers(3);
  std::vector<std::unique_ptr<AttendCall>> live;
  for (int i = 0; i < 3; ++i) live.push_back(Call(Request(5 + i, 10 + i), answers[i]));
  std::vector<StartedStep> no_steps;
  auto ws = engine_->NewWorkspace();
  runner_.Run(live, no_steps, *ws);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Answer> got = answers[i].get();
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> alone = Alone(Request(5 + i, 10 + i));
    ASSERT_EQ(got->output.size(), alone.size());
    for (size_t j = 0; j < alone.size(); ++j) EXPECT_NEAR(got->output[j], alone[j], 1e-5);
    EXPECT_GT(live[i]->compute_time, absl::ZeroDuration());
  }
  const ModelStatistics::Snapshot s = statistics_.Read();
  EXPECT_EQ(s.execution_count, 1);
  EXPECT_EQ(s.inference_count, 3);
  EXPECT_EQ(s.batches.at(3).compute_infer.count, 1);  // one call of three requests
  const ModelMetrics& m = metrics_.ForModel("m");
  EXPECT_EQ(m.batch_requests->Collect().histogram.sample_sum, 3);
  EXPECT_EQ(m.tokens->Value(), 2 * (5 + 6 + 7));
}

TEST_F(EngineCallTest, AnAnswerMayHoldTheCallsOutputAndSendItFromThere) {
  std::shared_ptr<const void> owner;
  absl::Span<const float> sent;
  std::vector<std::unique_ptr<AttendCall>> live;
  live.push_back(
      testing::MakeCall(DecodeOwned(Request(6, 21)), [&](absl::StatusOr<AttentionResult> r) {
        ASSERT_TRUE(r.ok());
        owner = r->owner;  // as a response's slice does
        sent = r->output;
      }));
  std::vector<StartedStep> no_steps;
  auto ws = engine_->NewWorkspace();
  runner_.Run(live, no_steps, *ws);
  ASSERT_NE(owner, nullptr);
  live.clear();                     // the answered call (which kept its result)
  EXPECT_EQ(owner.use_count(), 1);  // the engine call let go; the answer holds it
  const std::vector<float> alone = Alone(Request(6, 21));
  ASSERT_EQ(sent.size(), alone.size());
  for (size_t j = 0; j < alone.size(); ++j) EXPECT_NEAR(sent[j], alone[j], 1e-5);
}

// A self-attention request of `rows` x `len` tokens with an FP16 query.
v1::AttendRequest HalfRequest(int64_t rows, int64_t len, uint32_t seed) {
  const std::vector<float> values = testing::RandomVector(rows * len * 24, seed);
  v1::AttendRequest r;
  r.set_model("m");
  v1::Tensor* query = r.mutable_query();
  query->set_dtype(v1::DATA_TYPE_FP16);
  for (const int64_t size : {rows, len, int64_t{24}}) query->add_shape(size);
  std::string data(values.size() * 2, '\0');
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), DType::kF16,
                   reinterpret_cast<uint8_t*>(data.data()));
  query->set_data(std::move(data));
  return r;
}

// What a call's Encode saw: the f32 output and the converted bytes.
struct Seen {
  absl::Status status;
  std::vector<float> output;
  std::vector<uint8_t> converted;
  DType converted_dtype = DType::kF32;
};

Seen RunOne(EngineCallRunner& runner, const MhaEngine& engine, const v1::AttendRequest& r,
            bool sends_converted) {
  Seen seen;
  std::vector<std::unique_ptr<AttendCall>> live;
  auto call = testing::MakeCall(DecodeOwned(r), [&](absl::StatusOr<AttentionResult> got) {
    seen.status = got.status();
    if (!got.ok()) return;
    seen.output.assign(got->output.begin(), got->output.end());
    seen.converted.assign(got->converted.bytes.begin(), got->converted.bytes.end());
    seen.converted_dtype = got->converted.dtype;
  });
  call->sends_converted = sends_converted;
  live.push_back(std::move(call));
  std::vector<StartedStep> no_steps;
  auto ws = engine.NewWorkspace();
  runner.Run(live, no_steps, *ws);
  return seen;
}

// From 256 KiB, an FP16 output leaves converted by the worker for a call
// that sends it so (the gRPC front ends): the bits ConvertFromFloat makes of
// the f32 output; smaller outputs, and calls that convert themselves, get
// the f32 output only.
TEST_F(EngineCallTest, LargeHalfOutputsAreConvertedWhereTheyAreChecked) {
  const v1::AttendRequest large = HalfRequest(8, 700, 31);  // 8 x 700 x 24 x 2 = 268,800 bytes
  for (const bool sends : {true, false}) {
    const Seen seen = RunOne(runner_, *engine_, large, sends);
    ASSERT_TRUE(seen.status.ok()) << seen.status;
    ASSERT_EQ(seen.output.size(), size_t{8 * 700 * 24});
    if (!sends) {
      EXPECT_TRUE(seen.converted.empty());
      continue;
    }
    std::vector<uint8_t> want(seen.output.size() * 2);
    ConvertFromFloat(seen.output.data(), static_cast<int64_t>(seen.output.size()), DType::kF16,
                     want.data());
    EXPECT_EQ(seen.converted_dtype, DType::kF16);
    EXPECT_EQ(seen.converted, want);
  }
  const Seen small = RunOne(runner_, *engine_, HalfRequest(1, 16, 5), true);
  ASSERT_TRUE(small.status.ok());
  EXPECT_TRUE(small.converted.empty());
}

// Weights so large that the scores overflow f32: a non-finite result is
// refused whether the worker converts the output or the front end does.
TEST_F(EngineCallTest, ANonFiniteResultIsRefusedWhereverItIsConverted) {
  PackedWeights huge = testing::RandomWeights(Dims(), 3);
  for (float& w : huge.w_q) w *= 1e20f;
  for (float& w : huge.w_k) w *= 1e20f;
  const std::unique_ptr<MhaEngine> engine = MhaEngine::Create(Dims(), huge).value();
  EngineCallRunner runner(*engine, metrics_.ForModel("m"), clock_, nullptr);
  for (const bool sends : {true, false}) {
    const Seen seen = RunOne(runner, *engine, HalfRequest(8, 700, 31), sends);
    EXPECT_EQ(seen.status.code(), absl::StatusCode::kInvalidArgument) << sends;
    EXPECT_THAT(seen.status.message(), HasSubstr("overflows float32"));
  }
}

TEST_F(EngineCallTest, StepsGoInACallOfTheirOwnAnsweredBeforeTheRequests) {
  ModelMetrics& m = metrics_.ForModel("m");
  auto calls = [&m] {
    return static_cast<double>(m.compute_duration->Collect().histogram.sample_count);
  };
  std::vector<StartedStep> steps;
  std::vector<std::future<absl::Status>> step_answers;
  std::vector<std::shared_ptr<double>> calls_at_answer;
  for (int64_t tokens : {1, 3}) {
    auto step = std::make_unique<TestStep>(*engine_, tokens, calls);
    step->statistics = &statistics_;
    step_answers.push_back(step->answer());
    calls_at_answer.push_back(step->calls_at_answer);
    StepPlan plan;
    absl::Status why;
    ASSERT_EQ(step->Begin(plan, why), StepTask::Start::kRun);
    ASSERT_TRUE(step->Allocate().ok());
    steps.push_back({std::move(step), plan});
  }
  std::future<absl::StatusOr<Answer>> answer;
  std::vector<std::unique_ptr<AttendCall>> live;
  live.push_back(Call(Request(6, 7), answer));
  auto ws = engine_->NewWorkspace();
  runner_.Run(live, steps, *ws);
  for (auto& a : step_answers) EXPECT_TRUE(a.get().ok());
  for (auto& c : calls_at_answer) EXPECT_EQ(*c, 1);  // their own call, before the request's
  EXPECT_TRUE(answer.get().ok());
  EXPECT_EQ(calls(), 2);
  EXPECT_EQ(statistics_.Read().inference_count, 3);  // a step is a request of one row
}

TEST_F(EngineCallTest, ProjectionsRunUnlessNobodyWaitsForThem) {
  auto ran = std::make_shared<testing::Outcome>(), dropped = std::make_shared<testing::Outcome>();
  std::vector<std::unique_ptr<ProjectionTask>> projections;
  projections.push_back(std::make_unique<testing::FakeProjection>(ran));
  auto expired = std::make_unique<testing::FakeProjection>(dropped);
  expired->deadline = clock_.Now() - absl::Seconds(1);
  projections.push_back(std::move(expired));
  auto ws = engine_->NewWorkspace();
  runner_.RunProjections(std::move(projections), *ws);
  EXPECT_EQ(ran->ran, 1);
  EXPECT_TRUE(ran->answer->ok());
  EXPECT_EQ(dropped->ran, 0);
  EXPECT_THAT(dropped->answer->message(), HasSubstr("while the encoder memory was queued"));
  EXPECT_EQ(dropped->dropped, std::vector<std::string>{"deadline"});
}

}  // namespace
}  // namespace mha::server
