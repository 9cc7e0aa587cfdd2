// SplitAttendCall without a batcher: the projection task hands over chunks of
// query rows, which computed as steps give the answer of the whole request;
// a failed chunk answers the call once and the later chunks are refused.
// And what Splittable lets through.
#include "server/scheduling/split_attend.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "engine/mha_engine.h"
#include "gtest/gtest.h"
#include "server/frontends/common/request_codec.h"
#include "tests/server/attend_requests.h"
#include "tests/server/scheduling/callback_call.h"

namespace mha::server {
namespace {

class SplitAttendTest : public ::testing::Test {
 protected:
  SplitAttendTest()
      : engine_(MhaEngine::Create(Dims(), testing::RandomWeights(Dims(), 3)).value()),
        ws_(MhaEngine::NewWorkspace()) {}

  // `request` as one engine run.
  std::vector<float> Whole(const v1::AttendRequest& request) {
    AttentionRequest d = DecodeOwned(request);
    std::vector<float> out(d.output_elements());
    EXPECT_TRUE(engine_->Run(d.batch(), {absl::MakeSpan(out), {}, false}, *ws_).ok());
    return out;
  }

  // Splits `request` into chunks of `rows` query rows, the answer going to
  // `answers`; runs the projection and returns the chunks it queued.
  std::vector<std::unique_ptr<StepTask>> Split(const v1::AttendRequest& request, int64_t rows) {
    std::unique_ptr<AttendCall> call =
        testing::MakeCall(DecodeOwned(request), [this](absl::StatusOr<AttentionResult> result) {
          answers_.push_back(result.status());
          if (result.ok()) output_.assign(result->output.begin(), result->output.end());
        });
    std::vector<std::unique_ptr<StepTask>> chunks;
    std::unique_ptr<ProjectionTask> projection = SplitAttendCall(
        call, *engine_, rows,
        [&chunks](std::vector<std::unique_ptr<StepTask>> queued) { chunks = std::move(queued); },
        metrics_.ForModel("m"), /*statistics=*/nullptr);
    EXPECT_EQ(call, nullptr) << "the task took the call";
    projection->Run(*ws_);
    return chunks;
  }

  // One chunk as the batcher computes a step: Begin, Allocate, the
  // engine's step over the projected keys and values, Finish.
  void Compute(StepTask& chunk) {
    StepPlan plan;
    absl::Status why;
    ASSERT_EQ(chunk.Begin(plan, why), StepTask::Start::kRun) << why;
    ASSERT_TRUE(chunk.Allocate().ok());
    std::vector<float> out(plan.step.tokens * Dims().embed_dim);
    ASSERT_TRUE(engine_->Step({plan.query, {plan.step}}, {absl::MakeSpan(out), {}}, *ws_).ok());
    chunk.Finish(absl::OkStatus(), out, {});
  }

  std::unique_ptr<MhaEngine> engine_;
  std::unique_ptr<Workspace> ws_;
  Metrics metrics_;
  std::vector<absl::Status> answers_;
  std::vector<float> output_;
};

TEST_F(SplitAttendTest, ChunksComputedAsStepsGiveTheWholeRequestsAnswer) {
  const v1::AttendRequest request = Request(100, 7, /*key_padding=*/true);
  std::vector<std::unique_ptr<StepTask>> chunks = Split(request, 32);
  ASSERT_EQ(chunks.size(), 4u);
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i]->tokens(), i < 3 ? 32 : 4);
    EXPECT_TRUE(chunks[i]->attend_rows());
    EXPECT_EQ(chunks[i]->session(), chunks[0]->session()) << "one call's chunks wait in turn";
  }
  // In any order: each chunk writes its own rows.
  for (size_t i : {2, 0, 3}) Compute(*chunks[i]);
  EXPECT_TRUE(answers_.empty()) << "answered only when the last chunk is in";
  Compute(*chunks[1]);
  ASSERT_EQ(answers_.size(), 1u);
  ASSERT_TRUE(answers_[0].ok()) << answers_[0];
  const std::vector<float> whole = Whole(request);
  ASSERT_EQ(output_.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    ASSERT_NEAR(output_[i], whole[i], 1e-5f) << "element " << i;
  }
}

TEST_F(SplitAttendTest, AFailedChunkAnswersOnceAndTheRestAreRefused) {
  std::vector<std::unique_ptr<StepTask>> chunks = Split(Request(50, 8), 20);
  ASSERT_EQ(chunks.size(), 3u);
  Compute(*chunks[0]);
  chunks[1]->Fail(absl::DeadlineExceededError("late"));
  ASSERT_EQ(answers_.size(), 1u);
  EXPECT_EQ(answers_[0].code(), absl::StatusCode::kDeadlineExceeded);
  StepPlan plan;
  absl::Status why;
  EXPECT_EQ(chunks[2]->Begin(plan, why), StepTask::Start::kRefused);
  chunks[2]->Fail(why);
  EXPECT_EQ(answers_.size(), 1u) << "answered exactly once";
}

TEST_F(SplitAttendTest, OnlyOneSequenceWithoutMaskCausalOrWeightsIsSplittable) {
  EXPECT_TRUE(Splittable(DecodeOwned(Request(40, 1, /*key_padding=*/true)), *engine_));
  v1::AttendRequest causal = Request(40, 1);
  causal.set_is_causal(true);
  EXPECT_FALSE(Splittable(DecodeOwned(causal), *engine_));
  v1::AttendRequest weights = Request(40, 1);
  weights.set_need_weights(true);
  EXPECT_FALSE(Splittable(DecodeOwned(weights), *engine_));
  v1::AttendRequest two = Request(40, 1);
  *two.mutable_query() = Wire({2, 40, 24}, testing::RandomVector(2 * 40 * 24, 2));
  EXPECT_FALSE(Splittable(DecodeOwned(two), *engine_));
  v1::AttendRequest masked = Request(4, 1);
  *masked.mutable_attn_mask() = BoolWire({4, 4}, std::vector<uint8_t>(16, 0));
  EXPECT_FALSE(Splittable(DecodeOwned(masked), *engine_));
}

}  // namespace
}  // namespace mha::server
