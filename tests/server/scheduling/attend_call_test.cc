// AttendCall: the exactly-once answer every Attend call gives.
#include "server/scheduling/attend_call.h"

#include <new>
#include <vector>

#include "gtest/gtest.h"

namespace mha::server {
namespace {

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

}  // namespace
}  // namespace mha::server
