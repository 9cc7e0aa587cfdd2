// A warm MhaEngine::Run allocates nothing of its own, and a workspace's
// cached oneDNN memory objects follow new buffers correctly.
//
// Every operator new in this binary is counted. The binary is linked with
// -Wl,--wrap=dnnl_primitive_execute, so the engine's calls into oneDNN's
// execute come through __wrap_dnnl_primitive_execute below, which counts
// them and sets aside the allocations oneDNN 2.6 makes inside (it builds an
// argument map on every call, which no API of 2.6 avoids).
#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "engine/mha_engine.h"
#include "gtest/gtest.h"
#include "oneapi/dnnl/dnnl.h"
#include "tests/test_models.h"

namespace {
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_allocations_in_execute{0};
std::atomic<int64_t> g_executes{0};
}  // namespace

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

extern "C" dnnl_status_t __real_dnnl_primitive_execute(const_dnnl_primitive_t, dnnl_stream_t,
                                                       int, const dnnl_exec_arg_t*);
extern "C" dnnl_status_t __wrap_dnnl_primitive_execute(const_dnnl_primitive_t primitive,
                                                       dnnl_stream_t stream, int nargs,
                                                       const dnnl_exec_arg_t* args) {
  const int64_t before = g_allocations.load();
  const dnnl_status_t status = __real_dnnl_primitive_execute(primitive, stream, nargs, args);
  g_allocations_in_execute.fetch_add(g_allocations.load() - before);
  g_executes.fetch_add(1);
  return status;
}

namespace mha::testing {
namespace {

struct Counts {
  int64_t ours = 0;      // allocations outside oneDNN's execute
  int64_t executes = 0;  // oneDNN primitive executions
};

// Self-attention (or cross-attention with `kv_len` keys) of one sequence.
struct Request {
  std::vector<float> query, key, output;
  AttentionBatch batch;

  Request(const AttentionDims& d, int64_t len, int64_t kv_len, uint32_t seed)
      : query(RandomVector(len * d.embed_dim, seed)),
        key(kv_len == 0 ? std::vector<float>{} : RandomVector(kv_len * d.kdim, seed + 1)),
        output(len * d.embed_dim) {
    batch.query = query;
    batch.key = key;
    batch.q_offsets = {0, len};
    batch.kv_offsets = {0, kv_len == 0 ? len : kv_len};
  }
};

Counts RunCounted(const MhaEngine& engine, Request& r, Workspace& ws) {
  const int64_t all = g_allocations.load(), in_execute = g_allocations_in_execute.load();
  const int64_t executes = g_executes.load();
  const absl::Status status = engine.Run(r.batch, {absl::MakeSpan(r.output), {}, false}, ws);
  Counts c;
  c.ours = (g_allocations.load() - all) - (g_allocations_in_execute.load() - in_execute);
  c.executes = g_executes.load() - executes;
  EXPECT_TRUE(status.ok()) << status;
  return c;
}

std::unique_ptr<MhaEngine> Engine(const AttentionDims& d, int64_t runtime_dims_max_scores) {
  EngineOptions options;
  options.runtime_dims_max_scores = runtime_dims_max_scores;
  auto engine = MhaEngine::Create(d, RandomWeights(d, 3), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

// Lengths whose attention runs in plain loops (16), on the runtime-shape
// primitive (100) and on per-shape primitives (300): in each, once the
// shape has been seen, a call allocates nothing outside oneDNN.
TEST(EngineAllocationTest, WarmRunAllocatesNothingOutsideOneDnn) {
  for (const bool bf16 : {false, true}) {
    for (const bool cross : {false, true}) {
      AttentionDims d = MakeDims(64, 2);
      d.bf16 = bf16;
      const std::unique_ptr<MhaEngine> engine = Engine(d, /*default*/ -1);
      std::unique_ptr<Workspace> ws = engine->NewWorkspace();
      for (const int64_t len : {16, 100, 300}) {
        SCOPED_TRACE(::testing::Message() << "bf16 " << bf16 << " cross " << cross
                                          << " len " << len);
        Request r(d, len, cross ? len + 7 : 0, 5);
        RunCounted(*engine, r, *ws);  // warm-up: primitives and buffers
        const Counts warm = RunCounted(*engine, r, *ws);
        EXPECT_EQ(warm.ours, 0);
        EXPECT_GE(warm.executes, 2);  // at least the two projections
      }
    }
  }
}

// The cached memory objects are re-pointed at each call's buffers: runs on
// a warm workspace with other inputs and outputs (all alive at once, so at
// other addresses), and after a longer request has grown its buffers, give
// what a fresh workspace gives, on both kinds of attention primitive.
TEST(EngineAllocationTest, WarmWorkspaceFollowsNewBuffers) {
  const AttentionDims d = MakeDims(64, 2);
  for (const int64_t runtime_limit : {int64_t{0}, int64_t{4 * 128 * 128}}) {
    const std::unique_ptr<MhaEngine> engine = Engine(d, runtime_limit);
    std::unique_ptr<Workspace> warm = engine->NewWorkspace();
    std::vector<Request> on_warm, on_fresh;
    for (uint32_t i = 0; i < 4; ++i) {
      const int64_t len = i == 2 ? 400 : 100;
      on_warm.emplace_back(d, len, 0, i + 1);
      on_fresh.emplace_back(d, len, 0, i + 1);
    }
    for (size_t i = 0; i < on_warm.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "runtime limit " << runtime_limit << " call " << i);
      RunCounted(*engine, on_warm[i], *warm);
      std::unique_ptr<Workspace> fresh = engine->NewWorkspace();
      RunCounted(*engine, on_fresh[i], *fresh);
      EXPECT_EQ(on_warm[i].output, on_fresh[i].output);
    }
    EXPECT_NE(on_warm[0].output, on_warm[1].output);  // the inputs differ
  }
}

}  // namespace
}  // namespace mha::testing
