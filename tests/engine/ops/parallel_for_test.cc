// ForRange (engine/ops/parallel_for.h): each index once, shared across the
// team only at the top level, and no OpenMP region entered otherwise: the
// body's omp_get_level() says which region it runs in. The old `if`-clause
// loops entered a region every time (level 1 when serial, 2 when nested).
// Thread-safe under TSan: the threads report through atomics that outlive
// the test (TSan cannot see libgomp's barriers).
#include "engine/ops/parallel_for.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
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

}  // namespace
}  // namespace mha
