// The key-tiled path (online softmax over key tiles, row blocks shared out
// among threads) against the untiled path and the plain-loop reference.
#include <cmath>

#include "engine/mha_engine.h"
#include "engine/ops/avx512_kernels.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/test_models.h"

namespace mha::testing {
namespace {

EngineOptions TiledOptions(int64_t tile_rows, int64_t tile_keys) {
  EngineOptions o;
  o.tiled_min_keys = 1;
  o.tiled_min_rows = 1;
  o.one_pass_min_rows = 1;
  o.tile_rows = tile_rows;
  o.tile_keys = tile_keys;
  return o;
}

EngineOptions Untiled() {
  EngineOptions o;
  o.tiled_min_keys = 0;
  return o;
}

// Every option of the engine's cases, with tiles that cut rows and keys
// unevenly (so causal tiles are skipped, masks cross tile edges, and the
// appended bias_kv / zero_attn keys fall into a tile of their own).
TEST(TiledAttentionTest, EveryCaseMatchesUntiledPathAndReference) {
  for (const bool bf16 : {false, true}) {
    for (Case c : AllCases()) {
      c.dims.bf16 = bf16;
      const PackedWeights w = RandomWeights(c.dims, 7);
      const Built b = Build(c, 100);
      const RunResult plain = RunEngine(*MakeEngine(c.dims, w, Untiled()), c, b,
                                        /*with_weights=*/false);
      for (const auto& [rows, keys] : {std::pair{2, 3}, std::pair{5, 1}, std::pair{64, 64}}) {
        SCOPED_TRACE(::testing::Message()
                     << c.name << " bf16 " << bf16 << " tile " << rows << " x " << keys);
        const std::unique_ptr<MhaEngine> engine = MakeEngine(c.dims, w, TiledOptions(rows, keys));
        std::unique_ptr<Workspace> ws = engine->NewWorkspace();
        const RunResult tiled = RunEngine(*engine, c, b, /*with_weights=*/false, ws.get());
        EXPECT_GT(ws->num_children(), 0) << "the tiled path did not run";
        EXPECT_LE(MaxAbsDiff(plain.output.data(), tiled.output.data(), plain.output.size()),
                  bf16 ? 2e-2f : 1e-5f);
        ExpectMatchesReference(c, w, b, tiled, bf16 ? 3e-2f : 1e-5f,
                               /*check_weights=*/false);
      }
    }
  }
}

// Realistic tiles on longer sequences: several tiles per row block, masks
// and causal, fp32 and bf16. bf16 runs in one pass on a CPU with
// AVX512-BF16 (engine/ops/flash_bf16.h), and on oneDNN's products with the
// kernels capped below it (as on a CPU without), so both paths are covered.
TEST(TiledAttentionTest, LongSequencesMatchUntiledPath) {
  for (const auto& [bf16, cap] :
       {std::pair{false, KernelIsa::kAvx512Bf16}, std::pair{true, KernelIsa::kAvx512Bf16},
        std::pair{true, KernelIsa::kAvx512}}) {
    CapKernelIsaForTesting(cap);
    AttentionDims d = With(Dims(64, 4), [](AttentionDims& x) { x.add_zero_attn = true; });
    d.bf16 = bf16;
    const PackedWeights w = RandomWeights(d, 3);
    for (Case c :
         {Case{
              "long_self", d, {300, 130}, {}, false, MaskKind::kBool, MaskKind::kFloat, true, true},
          Case{"long_cross", d, {70}, {600}, true, MaskKind::kFloat}}) {
      SCOPED_TRACE(::testing::Message()
                   << c.name << " bf16 " << bf16 << " isa " << KernelIsaName(ActiveKernelIsa()));
      const Built b = Build(c, 11);
      const RunResult plain = RunEngine(*MakeEngine(d, w, Untiled()), c, b, false);
      const RunResult tiled = RunEngine(*MakeEngine(d, w, TiledOptions(64, 128)), c, b, false);
      EXPECT_LE(MaxAbsDiff(plain.output.data(), tiled.output.data(), plain.output.size()),
                bf16 ? 2e-2f : 1e-5f);
      ExpectMatchesReference(c, w, b, tiled, bf16 ? 3e-2f : 1e-5f, false);
    }
  }
  CapKernelIsaForTesting(KernelIsa::kAvx512Bf16);
}

// A batch whose key-tiled sequences lie between untiled ones: the tiled
// ones' blocks share one parallel region (one wave, or waves of a block a
// thread that cross from one sequence into the next), the untiled ones
// run alone; every sequence matches the reference and the untiled path,
// and the waves change no bit. fp32 on oneDNN's tiled products, bf16 in
// one pass where the CPU has AVX512-BF16.
TEST(TiledAttentionTest, TiledSequencesBetweenUntiledOnesShareOneRegion) {
  for (const bool bf16 : {false, true}) {
    AttentionDims d = Dims(32, 4);
    d.bf16 = bf16;
    const PackedWeights w = RandomWeights(d, 8);
    const Case c{"mixed",          d,    {50, 7, 45, 3, 61}, {}, false, MaskKind::kBool,
                 MaskKind::kFloat, true, /*causal=*/true};
    const Built b = Build(c, 21);
    EngineOptions o = TiledOptions(16, 16);
    o.tiled_min_keys = 40;     // 50, 45 and 61 tiled; 7 and 3 not
    o.one_pass_min_rows = 40;  // the same in one pass
    o.yield_wave_flops = 1;    // with a yield point: waves of a block a thread
    const std::unique_ptr<MhaEngine> engine = MakeEngine(d, w, o);
    SCOPED_TRACE(::testing::Message() << "bf16 " << bf16);
    std::unique_ptr<Workspace> ws = engine->NewWorkspace();
    const RunResult whole = RunEngine(*engine, c, b, /*with_weights=*/false, ws.get());
    EXPECT_GT(ws->num_children(), 0) << "the tiled path did not run";
    const RunResult plain = RunEngine(*MakeEngine(d, w, Untiled()), c, b, false);
    EXPECT_LE(MaxAbsDiff(plain.output.data(), whole.output.data(), plain.output.size()),
              bf16 ? 2e-2f : 1e-5f);
    ExpectMatchesReference(c, w, b, whole, bf16 ? 3e-2f : 1e-5f, /*check_weights=*/false);
    int yields = 0;
    ws->set_between_blocks([&] {
      ++yields;
      return true;
    });
    const RunResult waves = RunEngine(*engine, c, b, false, ws.get());
    // The tiled sequences' (row block, head) pairs in waves of one a thread
    // (two threads at most), each followed by a yield, and one yield after
    // the projection: at least 4 heads x 3 sequences (one pass takes each
    // sequence whole, 16-row blocks give 4 + 3 + 4).
    EXPECT_GE(yields, 1 + 4 * 3 / 2);
    EXPECT_EQ(MaxAbsDiff(waves.output.data(), whole.output.data(), whole.output.size()), 0.0f);
  }
}

// One pass reads queries, keys and values in place from the token-major
// projections (fused q/k/v rows 3E apart, fused k/v 2E apart, or separate
// rows E apart) instead of splitting them into heads. Queries' weights
// scaled up make the attention peaked, so that rows read from the wrong
// place or head move the outputs far beyond bf16's rounding (with the
// plain weights every key gets nearly the same share, whatever it holds).
TEST(TiledAttentionTest, QueriesKeysAndValuesReadInPlaceMatchTheSplitPath) {
  AttentionDims d = Dims(64, 4);
  d.bf16 = true;
  PackedWeights w = RandomWeights(d, 12);
  for (float& x : w.w_q) x *= 4.0f;
  for (const Case& c : {Case{"self",
                             d,
                             {70, 130},
                             {},
                             false,
                             MaskKind::kBool,
                             MaskKind::kNone,
                             true,
                             /*causal=*/true},
                        Case{"cross_kv_fused", d, {40, 66}, {150, 90}, true, MaskKind::kFloat},
                        Case{"cross", d, {65}, {129}}}) {
    SCOPED_TRACE(c.name);
    const Built b = Build(c, 5);
    const RunResult split = RunEngine(*MakeEngine(d, w, Untiled()), c, b, false);
    const RunResult in_place = RunEngine(*MakeEngine(d, w, TiledOptions(64, 64)), c, b, false);
    EXPECT_LE(MaxAbsDiff(split.output.data(), in_place.output.data(), split.output.size()), 4e-3f);
    ExpectMatchesReference(c, w, b, in_place, 3e-2f, /*check_weights=*/false);
  }
}

// Asking for the attention weights needs whole probability rows: such calls
// take the untiled path and still get them.
TEST(TiledAttentionTest, WeightsRequestsTakeTheUntiledPath) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 5);
  const Case c{"weights", d, {9}, {}, false, MaskKind::kBool};
  const Built b = Build(c, 3);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, w, TiledOptions(2, 3));
  std::unique_ptr<Workspace> ws = engine->NewWorkspace();
  const RunResult r = RunEngine(*engine, c, b, /*with_weights=*/true, ws.get());
  EXPECT_EQ(ws->num_children(), 0);
  ExpectMatchesReference(c, w, b, r, 1e-5f);
}

TEST(TiledAttentionTest, FullyMaskedRowsGiveTheOutputBias) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 2);
  const Case c{"all_masked", d, {7}, {}, false, MaskKind::kBool};
  Built b = Build(c, 1);
  std::fill(b.key_pad_bool.begin(), b.key_pad_bool.end(),
            1);  // every key masked
  const RunResult r = RunEngine(*MakeEngine(d, w, TiledOptions(2, 3)), c, b, false);
  for (int64_t i = 0; i < 7; ++i) {
    for (int64_t e = 0; e < 24; ++e) EXPECT_EQ(r.output[i * 24 + e], w.b_o[e]);
  }
}

// Inputs so large that scores overflow f32 give NaN outputs (which callers
// report), as on the untiled path, never finite garbage.
TEST(TiledAttentionTest, OverflowingScoresGiveNaNLikeTheUntiledPath) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 2);
  const Case c{"overflow", d, {6}, {}};
  Built b = Build(c, 1);
  for (float& x : b.query) x *= 1e25f;
  b.batch.query = b.query;
  for (const EngineOptions& options : {Untiled(), TiledOptions(2, 3)}) {
    const RunResult r = RunEngine(*MakeEngine(d, w, options), c, b, false);
    int nan_rows = 0;
    for (int64_t i = 0; i < 6; ++i) nan_rows += std::isnan(r.output[i * 24]) ? 1 : 0;
    EXPECT_GT(nan_rows, 0) << "tiled " << options.tiled_min_keys;
  }
}

TEST(TiledAttentionTest, SteadyStateCallsDoNotGrowTheWorkspace) {
  const AttentionDims d = Dims(32, 4);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, RandomWeights(d, 1), TiledOptions(8, 16));
  const Case c{"steady", d, {40, 33}, {}, false, MaskKind::kBool, MaskKind::kFloat};
  const Built b = Build(c, 4);
  std::unique_ptr<Workspace> ws = engine->NewWorkspace();
  RunEngine(*engine, c, b, false, ws.get());
  const size_t held = ws->bytes_held();
  RunEngine(*engine, c, b, false, ws.get());
  EXPECT_EQ(ws->bytes_held(), held);
}

}  // namespace
}  // namespace mha::testing
