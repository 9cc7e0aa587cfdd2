// The LRU caches of oneDNN primitives and memory objects, and warm-up: a
// full cache forgets its least recently used entry (not everything), and
// lengths warmed at load create no primitive on the request path.
#include <string>
#include <vector>

#include "engine/lru_cache.h"
#include "engine/onednn_matmul.h"
#include "engine/primitive_budget.h"
#include "engine/mha_engine.h"
#include "engine/model.h"
#include "gtest/gtest.h"
#include "tests/test_models.h"

namespace mha {
namespace {

TEST(LruCacheTest, AFullCacheEvictsOnlyTheLeastRecentlyUsed) {
  LruCache<int, std::string> cache(2);
  bool inserted = false;
  cache.FindOrInsert(1, inserted) = "one";
  EXPECT_TRUE(inserted);
  cache.FindOrInsert(2, inserted) = "two";
  ASSERT_NE(cache.Find(1), nullptr);  // 1 is now the most recent
  std::string& three = cache.FindOrInsert(3, inserted);
  three = "three";
  EXPECT_TRUE(inserted);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.Find(2), nullptr);  // evicted
  ASSERT_NE(cache.Find(1), nullptr);
  EXPECT_EQ(*cache.Find(1), "one");
  EXPECT_EQ(&cache.FindOrInsert(3, inserted), &three);  // references stay valid
  EXPECT_FALSE(inserted);
  EXPECT_EQ(three, "three");
}

// Every engine's primitive caches share one capacity: past it, the least
// recently used primitive of any cache goes (not the busy model's), and a
// destroyed engine gives its count back.
TEST(PrimitiveBudgetTest, CachesShareOneCapacityLeastRecentlyUsedFirst) {
  PrimitiveBudget& budget = PrimitiveBudget::Get();
  const int64_t capacity = budget.capacity();
  const dnnl::engine& engine = onednn::CpuEngine();
  auto spec = [](int64_t m) {
    MatmulSpec s;
    s.src_dt = s.wei_dt = s.dst_dt = onednn::dt::f32;
    s.ndims = 2;
    s.src_dims = {m, 8};
    s.src_strides = {8, 1};
    s.wei_dims = {8, 4};
    s.wei_strides = {4, 1};
    s.dst_dims = {m, 4};
    s.dst_strides = {4, 1};
    return s;
  };
  const int64_t before = budget.held();
  {
    MatmulCache idle(engine), busy(engine);
    for (int64_t m = 1; m <= 4; ++m) idle.Get(spec(m));  // the oldest uses
    budget.set_capacity(before + 6);
    for (int64_t m = 1; m <= 4; ++m) busy.Get(spec(m));
    EXPECT_EQ(budget.held(), before + 6);
    EXPECT_EQ(busy.size(), 4u) << "the busy cache keeps its recent primitives";
    EXPECT_EQ(idle.size(), 2u) << "the idle cache's two oldest went";
    const uint64_t misses = idle.misses();
    idle.Get(spec(4));  // still there: its newest survived
    EXPECT_EQ(idle.misses(), misses);
    busy.Get(spec(9));  // one more: the idle cache's oldest left goes
    EXPECT_EQ(idle.size(), 1u);
    EXPECT_EQ(budget.held(), before + 6);
  }
  EXPECT_EQ(budget.held(), before) << "destroyed caches give their count back";
  budget.set_capacity(capacity);
}

// Self-attention of one sequence of `len` tokens on a fresh workspace.
void RunSelf(const MhaEngine& engine, int64_t len) {
  const int64_t e = engine.dims().embed_dim;
  const std::vector<float> query = testing::RandomVector(len * e, 7);
  std::vector<float> output(len * e);
  AttentionBatch batch;
  batch.query = query;
  batch.q_offsets = {0, len};
  batch.kv_offsets = {0, 0};
  auto ws = engine.NewWorkspace();
  ASSERT_TRUE(engine.Run(batch, {absl::MakeSpan(output), {}, false}, *ws).ok());
}

TEST(WarmUpTest, WarmedLengthsCreateNoPrimitiveWhenServed) {
  for (const int64_t runtime_dims : {int64_t{-1}, int64_t{0}}) {  // and per-shape attention
    const AttentionDims dims = testing::MakeDims(32, 4);
    EngineOptions options;
    options.runtime_dims_max_scores = runtime_dims;
    auto engine = MhaEngine::Create(dims, testing::RandomWeights(dims, 5), options).value();
    const std::vector<int64_t> warm = {24, 40};
    ASSERT_TRUE(engine->WarmUp(warm).ok());
    const uint64_t after_warm_up = engine->PrimitiveCacheMisses();
    EXPECT_GT(after_warm_up, 0u);
    RunSelf(*engine, 24);
    RunSelf(*engine, 40);
    EXPECT_EQ(engine->PrimitiveCacheMisses(), after_warm_up) << runtime_dims;
    RunSelf(*engine, 33);  // a length nobody warmed
    EXPECT_GT(engine->PrimitiveCacheMisses(), after_warm_up) << runtime_dims;
  }
}

TEST(WarmUpTest, CrossAttentionModelsWarmOverAsManyKeys) {
  AttentionDims dims = testing::MakeDims(24, 3);
  dims.kdim = 16;
  dims.vdim = 20;
  auto engine = MhaEngine::Create(dims, testing::RandomWeights(dims, 6)).value();
  ASSERT_TRUE(engine->WarmUp(std::vector<int64_t>{12}).ok());
  const uint64_t after_warm_up = engine->PrimitiveCacheMisses();
  const std::vector<float> query = testing::RandomVector(12 * 24, 1);
  const std::vector<float> key = testing::RandomVector(12 * 16, 2);
  const std::vector<float> value = testing::RandomVector(12 * 20, 3);
  std::vector<float> output(12 * 24);
  AttentionBatch batch;
  batch.kind = AttentionKind::kCross;
  batch.query = query;
  batch.key = key;
  batch.value = value;
  batch.q_offsets = {0, 12};
  batch.kv_offsets = {0, 12};
  auto ws = engine->NewWorkspace();
  ASSERT_TRUE(engine->Run(batch, {absl::MakeSpan(output), {}, false}, *ws).ok());
  EXPECT_EQ(engine->PrimitiveCacheMisses(), after_warm_up);
}

TEST(WarmUpTest, ConfigWarmupLengthsAreCheckedAndRunAtLoad) {
  const AttentionDims dims = testing::MakeDims(16, 2);
  const PackedWeights weights = testing::RandomWeights(dims, 8);
  v1::ModelConfig config = testing::ConfigFor(dims);
  config.add_warmup_lengths(9);
  auto model = BuildModel(config, testing::WeightsAsTensors(dims, weights, WeightLayout::kInProj));
  ASSERT_TRUE(model.ok()) << model.status();
  const uint64_t loaded = model->engine->PrimitiveCacheMisses();
  EXPECT_GT(loaded, 0u);
  RunSelf(*model->engine, 9);
  EXPECT_EQ(model->engine->PrimitiveCacheMisses(), loaded);

  config.add_warmup_lengths(4097);
  EXPECT_EQ(ResolveDims(config).status().message(),
            "config: warmup_lengths must be in [1, 4096], got 4097");
  config.clear_warmup_lengths();
  for (int i = 1; i <= 17; ++i) config.add_warmup_lengths(i);
  EXPECT_EQ(ResolveDims(config).status().message(), "config: at most 16 warmup_lengths, got 17");
}

}  // namespace
}  // namespace mha
