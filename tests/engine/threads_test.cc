// The threads of engine calls: a oneDNN primitive runs on the threads it
// was created for, so the engine keeps one per thread count (a call runs on
// what its caller set), and warm-up covers every count calls use. Not in
// the ThreadSanitizer run: that build gives every call one thread.
#include "engine/threads.h"

#include <dlfcn.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "engine/mha_engine.h"
#include "engine/thread_choice.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using testing::RunSelf;

// Whether OpenMP runs on LLVM's runtime: the clang build's libomp, which
// also serves oneDNN's libgomp calls (it exports their GOMP_ entry points).
bool LlvmOpenMpRuntime() { return dlsym(RTLD_DEFAULT, "__kmpc_global_thread_num") != nullptr; }

// Threads of this process now.
int ThreadsInProcess() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++n;
  }
  return n;
}

// A oneDNN primitive runs on the threads it was created for. A caller set
// to one thread gets primitives of its own, even for shapes a two-thread
// caller met first, and so starts no OpenMP team (a new thread per caller)
// behind its back.
TEST(PrimitiveThreadsTest, ACallRunsOnItsCallersThreadsWhoeverMadeItsPrimitives) {
  for (const int64_t runtime_dims : {int64_t{-1}, int64_t{0}}) {
    const AttentionDims dims = testing::MakeDims(64, 4);
    EngineOptions options;
    options.runtime_dims_max_scores = runtime_dims;
    options.choose_small_call_threads = false;  // each call on its caller's count
    auto engine = MhaEngine::Create(dims, testing::RandomWeights(dims, 9), options).value();
    const int baseline = ThreadsInProcess();
    std::thread([&] {
      SetComputeThreads(2);
      RunSelf(*engine, 48);
    }).join();
    const uint64_t two_threads = engine->PrimitiveCacheMisses();
    // With GCC's libgomp (what ships), that thread's OpenMP team thread
    // exits on its own, detached: wait for it. LLVM's runtime keeps it in a
    // pool for the next team.
    if (!LlvmOpenMpRuntime()) {
      for (int i = 0; i < 500 && ThreadsInProcess() > baseline; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ASSERT_EQ(ThreadsInProcess(), baseline);
    }
    int before = 0, after = 0;
    uint64_t one_thread = 0;
    std::thread([&] {
      SetComputeThreads(1);
      before = ThreadsInProcess();
      RunSelf(*engine, 48);
      after = ThreadsInProcess();
      one_thread = engine->PrimitiveCacheMisses();
      RunSelf(*engine, 48);
    }).join();
    EXPECT_EQ(after, before) << "a one-thread call started threads; " << runtime_dims;
    EXPECT_GT(one_thread, two_threads) << runtime_dims;
    EXPECT_EQ(engine->PrimitiveCacheMisses(), one_thread) << runtime_dims;
  }
}

// With the process's call thread counts set (as the server's worker pool
// does), WarmUp makes the primitives of each: no count creates one when
// served.
TEST(PrimitiveThreadsTest, WarmUpCoversEveryThreadCountCallsUse) {
  const AttentionDims dims = testing::MakeDims(32, 4);
  auto engine = MhaEngine::Create(dims, testing::RandomWeights(dims, 5)).value();
  SetCallThreadCounts({1, 2});
  const absl::Status warmed = engine->WarmUp(std::vector<int64_t>{24});
  SetCallThreadCounts({});
  ASSERT_TRUE(warmed.ok()) << warmed;
  const uint64_t after_warm_up = engine->PrimitiveCacheMisses();
  for (const int threads : {1, 2}) {
    std::thread([&] {
      SetComputeThreads(threads);
      RunSelf(*engine, 24);
    }).join();
    EXPECT_EQ(engine->PrimitiveCacheMisses(), after_warm_up) << threads << " threads";
  }
}

// ThreadChoice: each way once, then the faster, with every
// kExploreEvery-th call the other way.
TEST(ThreadChoiceTest, TriesEachWayThenTakesTheFasterAndStillExplores) {
  ThreadChoice choice;
  const double macs = 1e6;
  const ThreadChoice::Pick first = choice.Choose(1, macs, 2);
  ASSERT_GE(first.slot, 0);
  EXPECT_FALSE(first.serial);
  choice.Record(first, macs, 20e-6);
  const ThreadChoice::Pick second = choice.Choose(1, macs, 2);
  EXPECT_TRUE(second.serial);
  choice.Record(second, macs, 10e-6);
  EXPECT_DOUBLE_EQ(choice.ParallelAverage(1, macs), 20e-12);
  EXPECT_DOUBLE_EQ(choice.SerialAverage(1, macs), 10e-12);
  std::vector<int> parallel_calls;  // the class's call numbers 2, 3, ...
  for (int n = 2; n < 2 + 2 * ThreadChoice::kExploreEvery; ++n) {
    if (!choice.Choose(1, macs, 2).serial) parallel_calls.push_back(n);
  }
  EXPECT_EQ(parallel_calls,
            (std::vector<int>{ThreadChoice::kExploreEvery, 2 * ThreadChoice::kExploreEvery}));
}

// One slow call (preempted, say) moves an average by at most an eighth of
// itself; a machine that really got slower flips the choice within a
// dozen calls; a faster one moves it halfway at once.
TEST(ThreadChoiceTest, FollowsTheMachineNotOneOutlier) {
  ThreadChoice choice;
  const double macs = 3e5;
  choice.Record(choice.Choose(0, macs, 2), macs, 30e-6);  // parallel: 1e-10 a mac
  choice.Record(choice.Choose(0, macs, 2), macs, 24e-6);  // serial: 8e-11
  ThreadChoice::Pick pick = choice.Choose(0, macs, 2);
  ASSERT_TRUE(pick.serial);
  choice.Record(pick, macs, 1e-3);  // one outlier, 40x
  EXPECT_DOUBLE_EQ(choice.SerialAverage(0, macs), 8e-11 * 1.125);
  EXPECT_TRUE(choice.Choose(0, macs, 2).serial);
  int serial_calls = 0;
  for (; serial_calls < 50; ++serial_calls) {  // serial now costs 1.6e-10 a mac
    pick = choice.Choose(0, macs, 2);
    if (!pick.serial) break;
    choice.Record(pick, macs, 48e-6);
  }
  EXPECT_GE(serial_calls, 2);
  EXPECT_LE(serial_calls, 12);
  choice.Record({pick.slot, true}, macs, 15e-6);  // 5e-11: faster again
  EXPECT_LT(choice.SerialAverage(0, macs), 1.1e-10);
  EXPECT_TRUE(choice.Choose(0, macs, 2).serial);
}

TEST(ThreadChoiceTest, OnlySmallCallsOfSeveralThreadsOutsideWarmUp) {
  ThreadChoice choice;
  EXPECT_EQ(choice.Choose(1, 2 * ThreadChoice::kMaxMacs, 2).slot, -1);
  EXPECT_EQ(choice.Choose(1, 1e5, 1).slot, -1);
  {
    const ScopedAllThreads warm_up;
    EXPECT_EQ(choice.Choose(1, 1e5, 2).slot, -1);
  }
  EXPECT_GE(choice.Choose(1, 1e5, 2).slot, 0);
  choice.Record({}, 1e5, 1.0);  // not a candidate: nothing recorded
  EXPECT_EQ(choice.ParallelAverage(1, 1e5), 0.0);
}

TEST(ThreadChoiceTest, KindsAndSizesAreApart) {
  ThreadChoice choice;
  choice.Record(choice.Choose(1, 1e6, 2), 1e6, 1e-5);
  EXPECT_GT(choice.ParallelAverage(1, 1e6), 0.0);
  EXPECT_GT(choice.ParallelAverage(1, 6e5), 0.0);  // the same power of two
  EXPECT_EQ(choice.ParallelAverage(0, 1e6), 0.0);
  EXPECT_EQ(choice.ParallelAverage(2, 1e6), 0.0);
  EXPECT_EQ(choice.ParallelAverage(1, 4e6), 0.0);
  EXPECT_EQ(choice.ParallelAverage(1, 2.5e5), 0.0);
}

// In a process whose calls may run on one thread (call thread counts with
// 1, as the server's), a small call on a two-thread caller runs on one
// thread at its class's second call (one-thread primitives appear), with
// the same answer; with the option off, or without 1 among the counts,
// it never does.
TEST(ThreadChoiceTest, SmallEngineCallsRunOnOneThreadOnlyWhereAllowed) {
  const AttentionDims dims = testing::MakeDims(40, 4);
  const PackedWeights weights = testing::RandomWeights(dims, 3);
  const int64_t len = 6;
  auto outputs_of = [&](const MhaEngine& engine, int calls) {
    std::vector<std::vector<float>> outputs;
    std::thread([&] {
      SetComputeThreads(2);
      const std::vector<float> query = testing::RandomVector(len * dims.embed_dim, 7);
      AttentionBatch batch;
      batch.query = query;
      batch.q_offsets = {0, len};
      batch.kv_offsets = {0, 0};
      auto ws = engine.NewWorkspace();
      for (int i = 0; i < calls; ++i) {
        std::vector<float> output(len * dims.embed_dim);
        ASSERT_TRUE(engine.Run(batch, {absl::MakeSpan(output), {}, false}, *ws).ok());
        outputs.push_back(std::move(output));
      }
    }).join();
    return outputs;
  };
  for (const bool choose : {false, true}) {
    for (const std::vector<int>& counts : {std::vector<int>{2}, std::vector<int>{1, 2}}) {
      EngineOptions options;
      options.choose_small_call_threads = choose;
      auto engine = MhaEngine::Create(dims, weights, options).value();
      SetCallThreadCounts(counts);
      const std::vector<std::vector<float>> first = outputs_of(*engine, 1);
      const uint64_t after_first = engine->PrimitiveCacheMisses();
      const std::vector<std::vector<float>> more = outputs_of(*engine, 3);
      SetCallThreadCounts({});
      const bool one_thread = choose && counts.size() == 2;
      EXPECT_EQ(engine->PrimitiveCacheMisses() > after_first, one_thread)
          << choose << " " << counts.size();
      for (const std::vector<float>& output : more) {
        for (size_t i = 0; i < output.size(); ++i) {
          ASSERT_NEAR(output[i], first[0][i], 1e-6) << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mha
