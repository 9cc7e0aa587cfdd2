// The LRU caches of oneDNN primitives and memory objects, and warm-up: a
// full cache forgets its least recently used entry (not everything), the
// column ranges of a stacked linear layer, and lengths warmed at load
// create no primitive on the request path.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/mha_engine.h"
#include "engine/model.h"
#include "engine/ops/kernels.h"
#include "engine/ops/linear_layer.h"
#include "engine/ops/lru_cache.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/ops/primitive_budget.h"
#include "engine/tensor.h"
#include "engine/threads.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

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

using testing::RunSelf;

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

// x [m, k] W^T + b through `layer`, from f32 `x`, as f32 (bf16 layers take
// and give bf16).
std::vector<float> RunLayer(const LinearLayer& layer, onednn::dt type, const std::vector<float>& x,
                            int64_t m, int64_t n) {
  auto ws = std::make_unique<Workspace>(onednn::CpuEngine());
  std::vector<float> y(m * n);
  if (type == onednn::dt::f32) {
    layer.Run(*ws, x.data(), m, y.data());
    return y;
  }
  std::vector<uint16_t> xb(x.size()), yb(y.size());
  ConvertToBf16(x.data(), xb.data(), static_cast<int64_t>(x.size()));
  layer.Run(*ws, xb.data(), m, yb.data());
  for (size_t i = 0; i < yb.size(); ++i) y[i] = Bf16ToFloat(yb[i]);
  return y;
}

// The q, k/v, k and v layers of a stacked q/k/v layer read its packed
// weights in place where the machine's format allows, and give exactly what
// a layer packed from those rows alone gives; where the format cannot be cut
// there, ColumnsOf says so (null) rather than read the wrong columns.
TEST(LinearLayerTest, ColumnRangesOfAStackedLayerAgreeWithTheirOwnPacks) {
  const dnnl::engine& engine = onednn::CpuEngine();
  std::vector<onednn::dt> types = {onednn::dt::f32};
  if (CpuCanComputeBf16()) types.push_back(onednn::dt::bf16);  // else no bf16 layer exists
  for (const onednn::dt type : types) {
    for (const int64_t e : {int64_t{64}, int64_t{256}, int64_t{40}}) {
      const int64_t n = 3 * e;
      const std::vector<float> weight = testing::RandomVector(n * e, 11);
      const std::vector<float> bias = testing::RandomVector(n, 12);
      const LinearLayer fused(engine, weight, bias, n, e, type, type);
      const std::pair<int64_t, int64_t> ranges[] = {{0, e}, {e, 2 * e}, {e, e}, {2 * e, e}};
      int shared = 0;
      for (const auto& [first, count] : ranges) {
        SCOPED_TRACE(::testing::Message() << "type " << static_cast<int>(type) << " e " << e
                                          << " columns " << first << "+" << count);
        std::unique_ptr<LinearLayer> part = LinearLayer::ColumnsOf(fused, first, count);
        if (part == nullptr) continue;
        ++shared;
        EXPECT_TRUE(part->shares_weights());
        EXPECT_EQ(part->bytes(), 0);
        const std::vector<float> rows(weight.begin() + first * e,
                                      weight.begin() + (first + count) * e);
        const std::vector<float> row_bias(bias.begin() + first, bias.begin() + first + count);
        const LinearLayer own(engine, rows, row_bias, count, e, type, type);
        for (const int64_t m : {int64_t{1}, int64_t{7}, int64_t{300}}) {
          const std::vector<float> x = testing::RandomVector(m * e, 13 + m);
          EXPECT_EQ(RunLayer(*part, type, x, m, count), RunLayer(own, type, x, m, count))
              << "m " << m;
        }
      }
      if (type == onednn::dt::f32 && e % 64 == 0) {
        // Both machines this runs on cut these: AVX-512's brgemm packs
        // 64-column blocks, AVX2's gemm reads row-major [k, n].
        EXPECT_EQ(shared, 4) << "e " << e;
      }
      ::testing::Test::RecordProperty(
          "shared_ranges_" + std::to_string(static_cast<int>(type)) + "_" + std::to_string(e),
          shared);
      std::printf("type %d e %ld: %d of 4 column ranges read the stacked weights in place\n",
                  static_cast<int>(type), static_cast<long>(e), shared);
    }
  }
  // Out-of-range requests are refused, not clamped.
  const LinearLayer small(engine, testing::RandomVector(64 * 32, 1), testing::RandomVector(64, 2),
                          64, 32, onednn::dt::f32, onednn::dt::f32);
  EXPECT_EQ(LinearLayer::ColumnsOf(small, 32, 64), nullptr);
  EXPECT_EQ(LinearLayer::ColumnsOf(small, -1, 8), nullptr);
  EXPECT_EQ(LinearLayer::ColumnsOf(small, 0, 0), nullptr);
}

// A self-attention model holds its weights packed once: the stacked q/k/v
// layer and the output layer; its q, k/v, k and v layers for cross calls
// and session steps read the stacked one in place (E = 256: whole column
// blocks on both machines), and cross calls still agree with PyTorch (the
// parity battery) and with the engine's other paths (engine_test).
TEST(LinearLayerTest, ASelfAttentionModelPacksItsWeightsOnce) {
  constexpr int64_t e = 256;
  const AttentionDims dims = testing::MakeDims(e, 8);
  auto engine = MhaEngine::Create(dims, testing::RandomWeights(dims, 3)).value();
  EXPECT_EQ(engine->WeightBytes(), static_cast<int64_t>((4 * e * e + 4 * e) * sizeof(float)));
}

}  // namespace
}  // namespace mha
