// When the deferred heap trim is due (server/scheduling/heap_trim.h).
#include "server/scheduling/heap_trim.h"

#include "gtest/gtest.h"

namespace mha::server {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);
const absl::Duration kQuiet = absl::Milliseconds(250);
const absl::Duration kAtMost = absl::Seconds(2);

TEST(TrimScheduleTest, NothingIsDueBeforeARequest) {
  TrimSchedule schedule(kQuiet, kAtMost);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
}

TEST(TrimScheduleTest, ATrimIsDueOnceRequestsHaveStoppedForTheQuietTime) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Request(kStart);
  EXPECT_EQ(schedule.due(), kStart + kQuiet);
  schedule.Request(kStart + absl::Milliseconds(100));  // another large one: later
  EXPECT_EQ(schedule.due(), kStart + absl::Milliseconds(100) + kQuiet);
}

TEST(TrimScheduleTest, RequestsThatNeverStopStillGetATrimAtMostThatLongAfterTheFirst) {
  TrimSchedule schedule(kQuiet, kAtMost);
  for (absl::Duration t; t < absl::Seconds(5); t += absl::Milliseconds(200)) {
    schedule.Request(kStart + t);
    EXPECT_LE(schedule.due(), kStart + kAtMost) << t;
  }
  EXPECT_EQ(schedule.due(), kStart + kAtMost);
}

TEST(TrimScheduleTest, AfterATrimTheNextRequestStartsAFreshSchedule) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Request(kStart);
  schedule.Done();
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
  const absl::Time later = kStart + absl::Seconds(10);
  schedule.Request(later);
  EXPECT_EQ(schedule.due(), later + kQuiet);  // not capped by the old first request
}

TEST(TrimScheduleTest, LargeWorkRunningHoldsTheTrimOffUpToTheLongestWait) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Started();
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());  // nothing freed yet
  schedule.Started();
  schedule.Finished(kStart);  // one done, the other still running
  EXPECT_EQ(schedule.due(), kStart + kAtMost);
  schedule.Finished(kStart + absl::Seconds(1));  // none running: quiet from the last
  EXPECT_EQ(schedule.due(), kStart + absl::Seconds(1) + kQuiet);
}

TEST(TrimScheduleTest, ARequestStampedEarlierThanTheLastDoesNotMoveTheTrimForward) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Request(kStart + absl::Milliseconds(100));
  schedule.Request(kStart);  // read its clock before the other one
  EXPECT_EQ(schedule.due(), kStart + absl::Milliseconds(100) + kQuiet);
}

}  // namespace
}  // namespace mha::server
