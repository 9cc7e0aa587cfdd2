// ForRange (engine/ops/parallel_for.h): each index once, shared across the
// team only at the top level, and no OpenMP region entered otherwise: the
// body's omp_get_level() says which region it runs in. The old `if`-clause
// loops entered a region every time (level 1 when serial, 2 when nested).
// CutIntoRuns: every item in exactly one run, runs in order, each about
// its share of the work.
// Thread-safe under TSan: the threads report through atomics that outlive
// the test (TSan cannot see libgomp's barriers).
#include "engine/ops/parallel_for.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace mha {
namespace {

constexpr int64_t kN = 1000;

TEST(ParallelForTest, TopLevelRunsEachIndexOnceInARegionOnlyWhenParallel) {
  for (const bool parallel : {false, true}) {
    std::vector<std::atomic<int>> runs(kN), levels(kN);
    ForRange(kN, parallel, [&](int64_t i) {
      runs[i].fetch_add(1);
      levels[i].store(omp_get_level());
    });
    const int expected_level = parallel && omp_get_max_threads() > 1 ? 1 : 0;
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(runs[i].load(), 1) << i << " parallel " << parallel;
      ASSERT_EQ(levels[i].load(), expected_level) << i << " parallel " << parallel;
    }
  }
}

// Inside a region (`threads` asked of it, one included: an inactive region
// still counts), every index runs on the thread that called, at the outer
// region's level.
void ExpectStaysInOuterRegion(int threads) {
  static std::atomic<int> stayed[2], team_size;
  for (auto& s : stayed) s.store(-1);
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    if (me == 0) team_size.store(omp_get_num_threads());
    bool ok = true;
    int64_t count = 0;
    ForRange(kN, /*parallel=*/true, [&](int64_t) {
      ok = ok && omp_get_thread_num() == me && omp_get_level() == 1;
      ++count;
    });
    if (me < 2) stayed[me].store(ok && count == kN ? 1 : 0);
  }
  for (int t = 0; t < std::min(team_size.load(), 2); ++t) {
    EXPECT_EQ(stayed[t].load(), 1) << "thread " << t << " of " << team_size.load();
  }
}

TEST(ParallelForTest, InsideAOneThreadRegionEntersNoRegion) { ExpectStaysInOuterRegion(1); }

TEST(ParallelForTest, InsideATwoThreadRegionEachCallerRunsItsOwnLoop) {
  ExpectStaysInOuterRegion(2);
}

// CutIntoRuns over `work` (items first .. first + work.size()).
std::vector<int64_t> Runs(const std::vector<int64_t>& work, int64_t threads, int64_t first = 0) {
  std::vector<int64_t> bounds(threads + 1, -1);
  int walks = 0;
  CutIntoRuns(
      first, first + static_cast<int64_t>(work.size()), threads,
      [&](auto visit) {
        ++walks;
        for (const int64_t w : work) visit(w);
      },
      bounds.data());
  EXPECT_EQ(walks, 2);
  return bounds;
}

TEST(CutIntoRunsTest, EqualItemsSplitEvenly) {
  EXPECT_EQ(Runs(std::vector<int64_t>(8, 5), 2), (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(Runs(std::vector<int64_t>(8, 5), 4), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(Runs(std::vector<int64_t>(6, 1), 2, /*first=*/10), (std::vector<int64_t>{10, 13, 16}));
}

TEST(CutIntoRunsTest, GrowingItemsSplitByWorkNotCount) {
  // A causal sequence's row blocks: 1 + ... + 8 = 36, half 18. Item 5
  // (work 6) spans 15 .. 21 with its middle on the half: it stays.
  EXPECT_EQ(Runs({1, 2, 3, 4, 5, 6, 7, 8}, 2), (std::vector<int64_t>{0, 6, 8}));
  // One large item and many small ones: the large one is a run alone.
  EXPECT_EQ(Runs({100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10}, 2),
            (std::vector<int64_t>{0, 1, 11}));
}

TEST(CutIntoRunsTest, FewerItemsThanThreadsLeaveSomeRunsEmpty) {
  EXPECT_EQ(Runs({7}, 4), (std::vector<int64_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(Runs({}, 2), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(Runs({0, 0, 0}, 2), (std::vector<int64_t>{0, 3, 3}));  // no work: one run
}

TEST(CutIntoRunsTest, RandomWorkCoversEveryItemOnceNearItsShare) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t threads = 1 + random() % 8;
    std::vector<int64_t> work(random() % 40);
    int64_t total = 0, largest = 0;
    for (int64_t& w : work) {
      w = random() % 1000;
      total += w;
      largest = std::max(largest, w);
    }
    const std::vector<int64_t> bounds = Runs(work, threads);
    ASSERT_EQ(bounds.front(), 0);
    ASSERT_EQ(bounds.back(), static_cast<int64_t>(work.size()));
    for (int64_t t = 0; t < threads; ++t) {
      ASSERT_LE(bounds[t], bounds[t + 1]) << "trial " << trial;
      int64_t run = 0;
      for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) run += work[i];
      // Each run ends within half an item of its share's end: at most the
      // share plus one item.
      EXPECT_LE(run * threads, total + largest * threads) << "trial " << trial << " run " << t;
    }
  }
}

}  // namespace
}  // namespace mha
