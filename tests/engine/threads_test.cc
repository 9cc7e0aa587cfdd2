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

}  // namespace
}  // namespace mha
