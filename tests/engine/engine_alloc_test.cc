// A warm MhaEngine::Run allocates nothing of its own (oneDNN's execute
// still does: see tests/engine/alloc_counter.h), and a workspace's cached oneDNN
// memory objects follow new buffers correctly.
#include <vector>

#include "engine/kv_cache.h"
#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "gtest/gtest.h"
#include "tests/engine/alloc_counter.h"
#include "tests/engine/test_models.h"

namespace mha::testing {
namespace {

// Self-attention (or cross-attention with `kv_len` keys) of one sequence.
struct Request {
  std::vector<float> query, key, output;
  AttentionBatch batch;

  Request(const AttentionDims& d, int64_t len, int64_t kv_len, uint32_t seed)
      : query(RandomVector(len * d.embed_dim, seed)),
        key(kv_len == 0 ? std::vector<float>{} : RandomVector(kv_len * d.kdim, seed + 1)),
        output(len * d.embed_dim) {
    batch.kind = kv_len == 0 ? AttentionKind::kSelf : AttentionKind::kCrossValueIsKey;
    batch.query = query;
    batch.key = key;
    batch.q_offsets = {0, len};
    batch.kv_offsets = {0, kv_len == 0 ? len : kv_len};
  }
};

AllocationCounts RunCounted(const MhaEngine& engine, Request& r, Workspace& ws) {
  const AllocationCounts before = CurrentAllocationCounts();
  const absl::Status status = engine.Run(r.batch, {absl::MakeSpan(r.output), {}, false}, ws);
  const AllocationCounts counts = CurrentAllocationCounts() - before;
  EXPECT_TRUE(status.ok()) << status;
  return counts;
}

std::unique_ptr<MhaEngine> Engine(const AttentionDims& d, int64_t runtime_dims_max_scores) {
  EngineOptions options;
  options.runtime_dims_max_scores = runtime_dims_max_scores;
  auto engine = MhaEngine::Create(d, RandomWeights(d, 3), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

// Lengths whose attention runs in plain loops (16), on the runtime-shape
// primitive (100), on per-shape primitives (300) and key-tiled on the
// threads' child workspaces (700): in each, once the shape has been seen,
// a call allocates nothing outside oneDNN.
TEST(EngineAllocationTest, WarmRunAllocatesNothingOutsideOneDnn) {
  for (const int type : {0, 1, 2}) {  // f32, bf16, int8 projections
    for (const bool cross : {false, true}) {
      AttentionDims d = MakeDims(64, 2);
      d.bf16 = type >= 1;
      d.int8 = type == 2;
      const std::unique_ptr<MhaEngine> engine = Engine(d, /*default*/ -1);
      std::unique_ptr<Workspace> ws = engine->NewWorkspace();
      for (const int64_t len : {16, 100, 300, 700}) {
        SCOPED_TRACE(::testing::Message()
                     << "type " << type << " cross " << cross << " len " << len);
        Request r(d, len, cross ? len + 7 : 0, 5);
        RunCounted(*engine, r, *ws);  // warm-up: primitives and buffers
        const AllocationCounts warm = RunCounted(*engine, r, *ws);
        EXPECT_EQ(warm.outside_onednn_execute(), 0);
        EXPECT_GE(warm.executes, 2);  // at least the two projections
      }
    }
  }
}

// The cached memory objects are re-pointed at each call's buffers: runs on
// a warm workspace with other inputs and outputs (all alive at once, so at
// other addresses), and after a longer request has grown its buffers (and
// run key-tiled), give what a fresh workspace gives, on both kinds of
// attention primitive.
TEST(EngineAllocationTest, WarmWorkspaceFollowsNewBuffers) {
  const AttentionDims d = MakeDims(64, 2);
  for (const int64_t runtime_limit : {int64_t{0}, int64_t{4 * 128 * 128}}) {
    const std::unique_ptr<MhaEngine> engine = Engine(d, runtime_limit);
    std::unique_ptr<Workspace> warm = engine->NewWorkspace();
    std::vector<Request> on_warm, on_fresh;
    for (uint32_t i = 0; i < 4; ++i) {
      const int64_t len = i == 2 ? 700 : 100;
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

// MhaEngine::ScratchBytes, what admission control charges from the shape
// alone, bounds what a fresh workspace holds after the run, and is not
// wildly above it: every path (plain loops, per-shape primitives, blocks of
// rows, key-tiled), self and cross, f32, bf16 and int8 projections, with
// weights and masks.
TEST(EngineAllocationTest, ScratchBytesBoundsWhatRunHolds) {
  SetComputeThreads(2);
  for (const int type : {0, 1, 2}) {  // f32, bf16, int8 projections
    for (const bool cross : {false, true}) {
      AttentionDims d = MakeDims(64, 2);
      d.bf16 = type >= 1;
      d.int8 = type == 2;
      d.add_bias_kv = cross;
      const std::unique_ptr<MhaEngine> engine = Engine(d, /*default*/ -1);
      for (const int64_t len : {16, 300, 700, 3000}) {
        for (const bool weights : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "type " << type << " cross " << cross << " len "
                                            << len << " weights " << weights);
          const int64_t n = 3, kv_len = cross ? len / 2 + 5 : len;
          const std::vector<float> query = RandomVector(n * len * d.embed_dim, 1);
          const std::vector<float> key =
              cross ? RandomVector(n * kv_len * d.kdim, 2) : std::vector<float>{};
          const std::vector<uint8_t> padding(n * kv_len, 0);
          AttentionBatch batch;
          batch.kind = cross ? AttentionKind::kCrossValueIsKey : AttentionKind::kSelf;
          batch.query = query;
          batch.key = key;
          SetUniformOffsets(n, len, kv_len, d.num_heads, batch);
          batch.key_padding_mask = {DType::kBool, padding.data(),
                                    static_cast<int64_t>(padding.size())};
          std::vector<float> output(n * len * d.embed_dim);
          std::vector<float> probs(weights ? engine->WeightsElements(batch, false) : 0);
          std::unique_ptr<Workspace> ws = engine->NewWorkspace();
          ASSERT_TRUE(
              engine->Run(batch, {absl::MakeSpan(output), absl::MakeSpan(probs), false}, *ws).ok());
          BatchShape shape{.rows = n,
                           .q_len = len,
                           .kv_len = kv_len,
                           .self_attention = !cross,
                           .value_is_key = true,
                           .bool_mask_elements = n * kv_len,
                           .need_weights = weights};
          const int64_t held = static_cast<int64_t>(ws->bytes_held());
          const int64_t estimate = engine->ScratchBytes(shape, 2);
          EXPECT_LE(held, estimate);
          EXPECT_LE(estimate, 2 * held + (int64_t{12} << 20));
          // A workspace above what it may keep gives everything back.
          EXPECT_TRUE(ws->ReleaseIfAbove(0));
          EXPECT_EQ(ws->bytes_held(), 0u);
          std::vector<float> again(output.size());
          ASSERT_TRUE(
              engine->Run(batch, {absl::MakeSpan(again), absl::MakeSpan(probs), false}, *ws).ok());
          EXPECT_EQ(again, output);
        }
      }
    }
  }
}

// MhaEngine::StepScratchBytes, what admission charges a session step,
// bounds what a fresh workspace holds after the step (one step of a self
// session after `position` cached tokens), and is not wildly above it. The
// cache is filled once per position; each case steps a fork of it.
TEST(EngineAllocationTest, StepScratchBytesBoundsWhatStepHolds) {
  SetComputeThreads(2);
  for (const int type : {0, 1, 2}) {  // f32, bf16, int8 projections
    AttentionDims d = MakeDims(64, 2);
    d.bf16 = type >= 1;
    d.int8 = type == 2;
    d.add_bias_kv = true;  // one extra key
    const std::unique_ptr<MhaEngine> engine = Engine(d, /*default*/ -1);
    for (const int64_t position : {0, 100, 3000}) {
      KvBlockPool pool(int64_t{256} << 20);
      KvCache filled(engine->kv_layout(), pool);
      if (position > 0) {
        ASSERT_TRUE(filled.Reserve(position).ok());
        const std::vector<float> prefix = RandomVector(position * d.embed_dim, 1);
        StepBatch fill;
        fill.query = prefix;
        fill.steps.push_back({&filled, position, false});
        std::vector<float> out(prefix.size());
        auto fill_ws = engine->NewWorkspace();
        ASSERT_TRUE(engine->Step(fill, {absl::MakeSpan(out), {}}, *fill_ws).ok());
      }
      for (const int64_t tokens : {1, 16, 300}) {
        for (const bool weights : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "type " << type << " position " << position
                                            << " tokens " << tokens << " weights " << weights);
          const std::unique_ptr<KvCache> cache = filled.Fork(position);
          ASSERT_EQ(cache->length(), position);
          ASSERT_TRUE(cache->Reserve(position + tokens).ok());
          const std::vector<float> query = RandomVector(tokens * d.embed_dim, 2);
          StepBatch step;
          step.query = query;
          step.steps.push_back({cache.get(), tokens, false});
          std::vector<float> out(query.size());
          std::vector<float> probs(weights ? engine->StepWeightsElements(step) : 0);
          auto ws = engine->NewWorkspace();  // fresh: what this step alone holds
          ASSERT_TRUE(engine->Step(step, {absl::MakeSpan(out), absl::MakeSpan(probs)}, *ws).ok());
          const int64_t held = static_cast<int64_t>(ws->bytes_held());
          const int64_t keys = position + tokens + d.extra_keys();
          const int64_t estimate = engine->StepScratchBytes(tokens, keys, weights, 2);
          EXPECT_LE(held, estimate);
          EXPECT_LE(estimate, 2 * held + (int64_t{12} << 20));
        }
      }
    }
  }
}

}  // namespace
}  // namespace mha::testing
