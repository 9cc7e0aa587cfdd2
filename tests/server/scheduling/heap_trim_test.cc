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

TEST(TrimScheduleTest, AResidentSetGrownSinceTheLastTrimRequestsOne) {
  const int64_t mib = int64_t{1} << 20;
  TrimSchedule schedule(kQuiet, kAtMost, /*growth=*/4 * mib);
  schedule.Resident(kStart, 100 * mib);  // the first reading: the baseline
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
  schedule.Resident(kStart + absl::Seconds(5), 104 * mib);  // not more than the growth
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
  const absl::Time grown = kStart + absl::Seconds(10);
  schedule.Resident(grown, 105 * mib);
  EXPECT_EQ(schedule.due(), grown + kQuiet);
  schedule.Done();
  schedule.Trimmed(101 * mib);  // what the trim left: the new baseline
  schedule.Resident(grown + absl::Seconds(5), 104 * mib);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
  schedule.Resident(grown + absl::Seconds(10), 106 * mib);
  EXPECT_EQ(schedule.due(), grown + absl::Seconds(10) + kQuiet);
}

TEST(TrimScheduleTest, ATrimMadeWhileRequestsWereInFlightDoesNotRaiseTheBar) {
  const int64_t mib = int64_t{1} << 20;
  TrimSchedule schedule(kQuiet, kAtMost, /*growth=*/4 * mib);
  schedule.Resident(kStart, 100 * mib);
  schedule.Done();
  schedule.Trimmed(112 * mib);  // requests held 12 MiB at that moment
  schedule.Resident(kStart + absl::Seconds(5), 105 * mib);
  EXPECT_EQ(schedule.due(), kStart + absl::Seconds(5) + kQuiet) << "measured from 100, not 112";
}

TEST(TrimScheduleTest, AnIdleSpellWithFreeHeapRequestsOneTrim) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Activity(kStart, /*idle=*/false, 64 * kIdleHeapFree);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture()) << "busy: the allocator keeps its caches";
  schedule.Activity(kStart + absl::Seconds(5), /*idle=*/true, kIdleHeapFree);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture()) << "idle, but too little free to bother";
  const absl::Time idle = kStart + absl::Seconds(10);
  schedule.Activity(idle, /*idle=*/true, kIdleHeapFree + 1);
  EXPECT_EQ(schedule.due(), idle + kQuiet);
  schedule.Done();
  schedule.Activity(idle + absl::Seconds(5), /*idle=*/true, 64 * kIdleHeapFree);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture()) << "one trim a spell: what it left stays";
  schedule.Activity(idle + absl::Seconds(10), /*idle=*/false, 64 * kIdleHeapFree);
  const absl::Time idle_again = idle + absl::Seconds(15);
  schedule.Activity(idle_again, /*idle=*/true, 64 * kIdleHeapFree);
  EXPECT_EQ(schedule.due(), idle_again + kQuiet);
}

TEST(TrimScheduleTest, WithoutAGrowthTheResidentSetRequestsNothing) {
  TrimSchedule schedule(kQuiet, kAtMost);
  schedule.Resident(kStart, 100);
  schedule.Resident(kStart + absl::Seconds(5), int64_t{1} << 40);
  EXPECT_EQ(schedule.due(), absl::InfiniteFuture());
}

}  // namespace
}  // namespace mha::server
