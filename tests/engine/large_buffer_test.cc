// engine/large_buffer.h's kept transient buffers: a freed one is taken again
// by the next call of its size, a miss gives back everything kept, and the
// total kept stays bounded.
#include "engine/large_buffer.h"

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace mha {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class KeptLargeTest : public ::testing::Test {
 protected:
  void SetUp() override { ReleaseKeptLarge(); }
  void TearDown() override { ReleaseKeptLarge(); }
};

TEST_F(KeptLargeTest, AFreedBufferIsTakenAgainBySameSizedCall) {
  const float* first = nullptr;
  {
    LargeArray<float> a(kMiB / 2);  // 2 MiB
    first = a.data();
    std::memset(a.data(), 1, 2 * kMiB);
  }
  EXPECT_EQ(KeptLargeBytes(), 2 * kMiB);
  LargeArray<float> b(kMiB / 2);
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(KeptLargeBytes(), 0u);
}

TEST_F(KeptLargeTest, ACallTakesTheSmallestKeptBufferUpToTwiceItsSize) {
  size_t c4 = 0, c8 = 0;
  void* four = TakeLarge(4 * kMiB, &c4);
  void* eight = TakeLarge(8 * kMiB, &c8);
  ASSERT_EQ(c4, 4 * kMiB);
  ASSERT_EQ(c8, 8 * kMiB);
  ReturnLarge(eight, c8);
  ReturnLarge(four, c4);
  size_t c = 0;
  EXPECT_EQ(TakeLarge(3 * kMiB, &c), four);  // 4 MiB fits 3, and is smaller than 8
  EXPECT_EQ(c, 4 * kMiB);
  ReturnLarge(four, c);
  EXPECT_EQ(TakeLarge(5 * kMiB, &c), eight);  // only 8 MiB fits
  EXPECT_EQ(c, 8 * kMiB);
  ReturnLarge(eight, c);
}

TEST_F(KeptLargeTest, AMissGivesBackEverythingKeptBeforeItAllocates) {
  size_t c = 0;
  void* small = TakeLarge(2 * kMiB, &c);
  ReturnLarge(small, c);
  ASSERT_EQ(KeptLargeBytes(), 2 * kMiB);
  void* big = TakeLarge(5 * kMiB, &c);  // 2 MiB is too small for it
  EXPECT_EQ(c, 6 * kMiB);               // rounded up to huge pages
  EXPECT_EQ(KeptLargeBytes(), 0u);
  ReturnLarge(big, c);
  ASSERT_EQ(KeptLargeBytes(), 6 * kMiB);
  void* two = TakeLarge(2 * kMiB, &c);  // 6 MiB is more than twice 2: a miss
  EXPECT_EQ(c, 2 * kMiB);
  EXPECT_EQ(KeptLargeBytes(), 0u);
  ReturnLarge(two, c);
}

TEST_F(KeptLargeTest, SmallAndHugeBuffersAreNeverKept) {
  { LargeArray<uint8_t> small(kHugePageBytes - 1); }
  EXPECT_EQ(KeptLargeBytes(), 0u);
  { LargeArray<uint8_t> huge(kKeptLargeBytes + 1); }
  EXPECT_EQ(KeptLargeBytes(), 0u);
}

TEST_F(KeptLargeTest, WhatIsKeptStaysWithinItsBound) {
  std::vector<std::pair<void*, size_t>> taken;
  for (int i = 0; i < 20; ++i) {  // 160 MiB in use at once
    size_t c = 0;
    void* p = TakeLarge(8 * kMiB, &c);
    taken.emplace_back(p, c);
  }
  for (const auto& [p, c] : taken) ReturnLarge(p, c);
  EXPECT_EQ(KeptLargeBytes(), kKeptLargeBytes);  // the newest eight
  ReleaseKeptLarge();
  EXPECT_EQ(KeptLargeBytes(), 0u);
}

// Two threads taking and returning buffers never get the same one at once:
// each fills its buffer with its own byte and finds it unchanged.
TEST_F(KeptLargeTest, ThreadsNeverShareABuffer) {
  auto churn = [](uint8_t mark) {
    for (int i = 0; i < 200; ++i) {
      LargeArray<uint8_t> a((2 + i % 2) * kMiB);
      std::memset(a.data(), mark, a.size());
      std::this_thread::yield();
      const volatile uint8_t* bytes = a.data();  // read back, not assumed
      for (size_t j = 0; j < a.size(); j += 4096) ASSERT_EQ(bytes[j], mark);
    }
  };
  std::thread other(churn, uint8_t{1});
  churn(2);
  other.join();
  EXPECT_LE(KeptLargeBytes(), kKeptLargeBytes);
}

}  // namespace
}  // namespace mha
