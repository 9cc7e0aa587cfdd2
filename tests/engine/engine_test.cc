// MhaEngine against the plain-loop reference, on odd sizes and every option.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "engine/mha_engine.h"
#include "engine/model.h"
#include "engine/threads.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/reference_mha.h"
#include "tests/engine/test_models.h"

namespace mha::testing {
namespace {

class EngineCaseTest : public ::testing::TestWithParam<Case> {};

TEST_P(EngineCaseTest, MatchesPlainLoopReference) {
  const Case& c = GetParam();
  const PackedWeights w = RandomWeights(c.dims, 7);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(c.dims, w);
  const Built b = Build(c, 100);
  ExpectMatchesReference(c, w, b, RunEngine(*engine, c, b), 1e-5f);
}

TEST_P(EngineCaseTest, Bf16ComputeStaysWithinBf16Tolerance) {
  Case c = GetParam();
  c.dims.bf16 = true;
  const PackedWeights w = RandomWeights(c.dims, 7);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(c.dims, w);
  const Built b = Build(c, 100);
  // Outputs are O(1); bf16 keeps ~3 significant digits through two products.
  // Where oneDNN has no bf16 kernels the engine computes in fp32 instead.
  EXPECT_EQ(engine->dims().bf16, CpuCanComputeBf16());
  ExpectMatchesReference(c, w, b, RunEngine(*engine, c, b), engine->dims().bf16 ? 3e-2f : 1e-5f);
}

// Int8 projections (compute_dtype INT8: the core in bf16 where native, as
// ResolveDims and MhaEngine::Create decide) on every option: within 2e-2
// of the fp32 reference (outputs are O(1); the parity battery holds the
// same against PyTorch), and not equal to it (int8 really computed).
TEST_P(EngineCaseTest, Int8ProjectionsStayWithinInt8Tolerance) {
  Case c = GetParam();
  c.dims.int8 = c.dims.bf16 = true;
  const PackedWeights w = RandomWeights(c.dims, 7);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(c.dims, w);
  EXPECT_EQ(engine->dims().int8, CpuHasInt8Dot());
  EXPECT_EQ(engine->dims().bf16, CpuHasNativeBf16());
  const Built b = Build(c, 100);
  const RunResult got = RunEngine(*engine, c, b);
  ExpectMatchesReference(c, w, b, got, engine->dims().int8 || engine->dims().bf16 ? 2e-2f : 1e-5f);
  if (engine->dims().int8) {
    c.dims.int8 = c.dims.bf16 = false;
    const RunResult fp32 = RunEngine(*MakeEngine(c.dims, w), c, b);
    EXPECT_GT(MaxAbsDiff(got.output.data(), fp32.output.data(), got.output.size()), 1e-5f);
  }
}

INSTANTIATE_TEST_SUITE_P(Options, EngineCaseTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) { return std::string(info.param.name); });

// The question users ask most: three q/k/v projections, one fused in_proj,
// or one small projection per head are the same math. Loaded from each
// layout, the engine packs the same matrices and gives identical bits.
TEST(EngineLayoutTest, AllWeightLayoutsGiveBitIdenticalOutputs) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 3);
  const Case c{"layouts", d, {4, 2}, {}, false, MaskKind::kBool};
  const Built b = Build(c, 5);
  std::vector<RunResult> results;
  for (WeightLayout layout : {WeightLayout::kInProj, WeightLayout::kSeparateProjWeights,
                              WeightLayout::kSeparateLinears, WeightLayout::kPerHeadLinears}) {
    absl::StatusOr<LoadedModel> model = BuildModel(ConfigFor(d), WeightsAsTensors(d, w, layout));
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->layout, layout);
    results.push_back(RunEngine(*model->engine, c, b));
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(results[0].output.data(), results[i].output.data(),
                             results[0].output.size() * sizeof(float)))
        << "layout " << i;
    EXPECT_EQ(results[0].weights, results[i].weights) << "layout " << i;
  }
  ExpectMatchesReference(c, w, b, results[0], 1e-5f);
}

// Multi-head is not single-head: with the same projection matrices, one
// head over E differs from h heads over E / h.
TEST(EngineHeadsTest, OneHeadDiffersFromManyHeadsOnSameWeights) {
  const AttentionDims many = Dims(32, 4);
  const AttentionDims one = Dims(32, 1);
  const PackedWeights w = RandomWeights(many, 11);  // same shapes for both
  const Case c_many{"many", many, {6}, {}};
  const Case c_one{"one", one, {6}, {}};
  const Built b = Build(c_many, 9);
  const RunResult r_many = RunEngine(*MakeEngine(many, w), c_many, b);
  const RunResult r_one = RunEngine(*MakeEngine(one, w), c_one, b);
  ExpectMatchesReference(c_many, w, b, r_many, 1e-5f);
  ExpectMatchesReference(c_one, w, b, r_one, 1e-5f);
  EXPECT_GT(MaxAbsDiff(r_many.output.data(), r_one.output.data(), r_one.output.size()), 1e-3f);
}

TEST(EngineMaskTest, FullyMaskedRowGetsZeroWeightsAndOutputBias) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 2);
  Case c{"all_masked", d, {3}, {}, false, MaskKind::kBool};
  c.per_head_weights = true;
  Built b = Build(c, 1);
  std::fill(b.key_pad_bool.begin(), b.key_pad_bool.end(), 1);  // every key masked
  const RunResult r = RunEngine(*MakeEngine(d, w), c, b);
  for (float x : r.weights) EXPECT_EQ(x, 0.0f);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t e = 0; e < 24; ++e) EXPECT_EQ(r.output[i * 24 + e], w.b_o[e]);
  }
}

TEST(EngineMaskTest, NoKeysAtAllGivesOutputBias) {
  const AttentionDims d = With(Dims(24, 3), [](AttentionDims& x) { x.kdim = x.vdim = 8; });
  const PackedWeights w = RandomWeights(d, 2);
  const Case c{"no_keys", d, {2, 2}, {0, 3}};
  const Built b = Build(c, 1);
  const RunResult r = RunEngine(*MakeEngine(d, w), c, b);
  for (int64_t e = 0; e < 24; ++e) EXPECT_EQ(r.output[e], w.b_o[e]);
  ExpectMatchesReference(c, w, b, r, 1e-5f);
}

// Long sequences run in blocks of query rows and heads (and equal-length
// sequences in smaller groups) when scores would exceed the budget: same
// numbers, and the same weights, averaged or per head.
TEST(EngineBlockingTest, SmallScoreBudgetGivesSameResults) {
  const AttentionDims d = With(Dims(24, 3), [](AttentionDims& x) { x.add_zero_attn = true; });
  // 15 rows of one head per block; 40 rows (a whole sequence) of 2 heads.
  const int64_t budgets[] = {15 * 41 * 4, 2 * 40 * 41 * 4};
  for (const AttentionDims& dims : {Dims(24, 3), d}) {
    for (const bool per_head : {false, true}) {
      Case c{"blocking", dims, {40, 40, 40, 7}, {}, false, MaskKind::kBool, MaskKind::kFloat};
      c.causal = true;
      c.per_head_weights = per_head;
      const PackedWeights wd = RandomWeights(dims, 4);
      const Built b = Build(c, 2);
      const RunResult whole = RunEngine(*MakeEngine(dims, wd), c, b);
      for (const int64_t budget : budgets) {
        SCOPED_TRACE(::testing::Message() << "budget " << budget << " per_head " << per_head);
        EngineOptions tiny;
        tiny.max_score_bytes = budget;
        const RunResult blocked = RunEngine(*MakeEngine(dims, wd, tiny), c, b);
        EXPECT_LE(MaxAbsDiff(whole.output.data(), blocked.output.data(), whole.output.size()),
                  1e-6f);
        EXPECT_LE(MaxAbsDiff(whole.weights.data(), blocked.weights.data(), whole.weights.size()),
                  1e-6f);
        ExpectMatchesReference(c, wd, b, blocked, 1e-5f);
      }
    }
  }
}

// Mid-sized blocks run on one runtime-shape primitive (fp32 by default),
// others on a primitive per shape: same numbers either way, in fp32 and
// bf16, for self- and cross-attention with masks.
TEST(EngineRuntimeDimsTest, RuntimeShapePrimitiveGivesSameResults) {
  for (const bool bf16 : {false, true}) {
    // Blocks of 2 heads x 90 x 100 scores: above the plain-loop size, below
    // the runtime-shape limit.
    AttentionDims d = Dims(64, 2);
    d.bf16 = bf16;
    const PackedWeights w = RandomWeights(d, 9);
    for (const Case& c :
         {Case{"rt_self", d, {90, 100}, {}, false, MaskKind::kBool, MaskKind::kFloat},
          Case{"rt_cross", d, {90, 70}, {100, 120}, true, MaskKind::kBool}}) {
      SCOPED_TRACE(::testing::Message() << c.name << " bf16 " << bf16);
      const Built b = Build(c, 4);
      EngineOptions per_shape, runtime;
      per_shape.runtime_dims_max_scores = 0;
      runtime.runtime_dims_max_scores = 4 * 128 * 128;
      const RunResult a = RunEngine(*MakeEngine(d, w, per_shape), c, b);
      const RunResult r = RunEngine(*MakeEngine(d, w, runtime), c, b);
      EXPECT_LE(MaxAbsDiff(a.output.data(), r.output.data(), a.output.size()),
                bf16 ? 2e-2f : 1e-5f);
      ExpectMatchesReference(c, w, b, r, bf16 ? 3e-2f : 1e-5f);
    }
  }
}

TEST(EngineRaggedTest, RaggedBatchEqualsSequencesRunAlone) {
  const AttentionDims d = With(Dims(24, 3), [](AttentionDims& x) { x.kdim = x.vdim = 12; });
  const PackedWeights w = RandomWeights(d, 5);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, w);
  const Case all{"ragged", d, {2, 9, 1, 4}, {3, 1, 8, 4}, true, MaskKind::kBool};
  const Built b = Build(all, 3);
  const RunResult together = RunEngine(*engine, all, b);
  for (size_t i = 0; i < all.q_lens.size(); ++i) {
    Built alone = Build(Case{"one", d, {all.q_lens[i]}, {all.kv_lens[i]}, true}, 0);
    alone.sequences[0] = b.sequences[i];  // same data as in the batch
    alone.query = b.sequences[i].query;
    alone.key = b.sequences[i].key;
    alone.key_pad_bool =
        b.sequences[i].key_padding.empty()
            ? std::vector<uint8_t>{}
            : std::vector<uint8_t>(b.key_pad_bool.begin() + b.batch.kv_offsets[i],
                                   b.key_pad_bool.begin() + b.batch.kv_offsets[i + 1]);
    alone.batch.query = alone.query;
    alone.batch.key = alone.key;
    AttachMask(MaskKind::kBool, alone.key_pad_bool, alone.key_pad_f32,
               alone.batch.key_padding_mask);
    const RunResult r = RunEngine(*engine, Case{"one", d, {all.q_lens[i]}, {1}}, alone);
    EXPECT_LE(MaxAbsDiff(r.output.data(), together.output.data() + b.batch.q_offsets[i] * 24,
                         r.output.size()),
              1e-6f)
        << "sequence " << i;
  }
}

TEST(EngineThreadsTest, ConcurrentRunsWithOwnWorkspacesAgree) {
  const AttentionDims d = Dims(32, 4);
  const PackedWeights w = RandomWeights(d, 6);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, w);
  const Case c{"threads", d, {7, 3, 12}, {}, false, MaskKind::kFloat};
  const Built b = Build(c, 8);
  const RunResult expected = RunEngine(*engine, c, b);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        if (RunEngine(*engine, c, b).output != expected.output) ++mismatches[t];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_THAT(mismatches, ::testing::Each(0));
}

TEST(EngineWorkspaceTest, SteadyStateCallsDoNotGrowTheWorkspace) {
  const AttentionDims d = Dims(24, 3);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, RandomWeights(d, 1));
  const Case c{"steady", d, {5, 8}, {}, false, MaskKind::kBool, MaskKind::kBool};
  const Built b = Build(c, 4);
  std::vector<float> output(13 * 24), weights(engine->WeightsElements(b.batch, false));
  const AttentionOutputs outputs{absl::MakeSpan(output), absl::MakeSpan(weights), false};
  std::unique_ptr<Workspace> ws = engine->NewWorkspace();
  ASSERT_TRUE(engine->Run(b.batch, outputs, *ws).ok());
  const size_t held = ws->bytes_held();
  ASSERT_TRUE(engine->Run(b.batch, outputs, *ws).ok());
  EXPECT_EQ(ws->bytes_held(), held);
}

// The VmFlags line of the mapping that holds `address` (/proc/self/smaps).
std::string VmFlagsOf(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2 && line.find('-') < 17) {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line + " ";
    }
  }
  return "";
}

// Large workspace buffers start on a 2 MiB boundary and are advised for
// transparent huge pages (a buffer released after a large call is faulted
// in again by the next, at microseconds a 4 KiB page); small ones stay
// 64-byte aligned.
TEST(EngineWorkspaceTest, LargeBuffersAreHugePageAlignedAndAdvised) {
  const AttentionDims d = Dims(24, 3);
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, RandomWeights(d, 1));
  std::unique_ptr<Workspace> ws = engine->NewWorkspace();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ws->Get(Workspace::kScores, 1000)) % 64, 0u);
  for (const size_t bytes : {size_t{2} << 20, size_t{5} << 20}) {
    void* large = ws->Get(Workspace::kHeadQ, bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % (size_t{2} << 20), 0u) << bytes;
    EXPECT_THAT(VmFlagsOf(large), ::testing::HasSubstr(" hg ")) << bytes;
  }
}

TEST(EngineValidationTest, InconsistentBatchesAreRejectedWithTheFieldNamed) {
  const AttentionDims d = With(Dims(24, 3), [](AttentionDims& x) { x.kdim = x.vdim = 8; });
  const std::unique_ptr<MhaEngine> engine = MakeEngine(d, RandomWeights(d, 1));
  const Case c{"valid", d, {2, 3}, {4, 1}, false, MaskKind::kBool, MaskKind::kBool};
  std::vector<float> output(5 * 24);
  auto run = [&](const Built& b, absl::Span<float> out, absl::Span<float> weights = {}) {
    std::unique_ptr<Workspace> ws = engine->NewWorkspace();
    return engine->Run(b.batch, {out, weights, false}, *ws);
  };
  const Built good = Build(c, 1);
  EXPECT_TRUE(run(good, absl::MakeSpan(output)).ok());
  // Run wants sequences: a batch without offsets is rejected (Compute reads
  // one as "no sequences" beside steps).
  {
    std::unique_ptr<Workspace> ws = engine->NewWorkspace();
    const absl::Status none = engine->Run(AttentionBatch{}, {{}, {}, false}, *ws);
    EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(none.message()), ::testing::HasSubstr("q_offsets"));
  }

  using ::testing::HasSubstr;
  auto expect_invalid = [&](const Built& b, absl::Span<float> out, const char* what,
                            absl::Span<float> weights = {}) {
    const absl::Status s = run(b, out, weights);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
  };
  expect_invalid(good, absl::MakeSpan(output).subspan(1), "output");
  std::vector<float> bad_weights(3);
  expect_invalid(good, absl::MakeSpan(output), "weights", absl::MakeSpan(bad_weights));
  Built b = Build(c, 1);
  b.batch.key = absl::MakeSpan(b.key).subspan(1);
  expect_invalid(b, absl::MakeSpan(output), "key");
  b = Build(c, 1);
  b.batch.q_offsets = {0, 3, 2};
  expect_invalid(b, absl::MakeSpan(output), "q_offsets");
  b = Build(c, 1);
  b.batch.kind = AttentionKind::kSelf;
  b.batch.key = {};
  b.batch.value = {};
  expect_invalid(b, absl::MakeSpan(output), "self-attention needs kdim");
  b = Build(c, 1);
  b.batch.key_padding_mask.num_elements -= 1;
  expect_invalid(b, absl::MakeSpan(output), "key_padding_mask");
  b = Build(c, 1);
  b.batch.attn_mask.num_elements -= 1;
  expect_invalid(b, absl::MakeSpan(output), "attn_mask");
  b = Build(c, 1);
  b.batch.attn_mask.dtype = DType::kF16;
  expect_invalid(b, absl::MakeSpan(output), "attn_mask: expected a BOOL or F32 mask");
}

TEST(EngineCreateTest, WeightsOfTheWrongSizeAreRejected) {
  const AttentionDims d = Dims(24, 3);
  PackedWeights w = RandomWeights(d, 1);
  w.w_o.pop_back();
  EXPECT_EQ(MhaEngine::Create(d, w).status().code(), absl::StatusCode::kInvalidArgument);
}

// The CPU flags the kernel reports (/proc/cpuinfo), each with a space on
// both sides so that " avx512f " matches that flag only.
std::string CpuFlags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1) + " ";
  }
  return "";
}

// oneDNN's view of bf16 support agrees with the flags the kernel reports
// (the server warns when a bf16 model would run emulated).
TEST(EngineCpuTest, NativeBf16MatchesCpuFlags) {
  const std::string flags = CpuFlags();
  ASSERT_FALSE(flags.empty());
  EXPECT_EQ(CpuHasNativeBf16(), flags.find(" avx512_bf16 ") != std::string::npos ||
                                    flags.find(" amx_bf16 ") != std::string::npos);
}

// int8 dot products are VNNI (AVX-512 or AVX) or AMX-INT8; an int8 model
// computes its projections in int8 exactly where the CPU has one of them,
// and holds its projection weights in a quarter of fp32's bytes there.
TEST(EngineCpuTest, Int8ComputeNeedsInt8Dot) {
  const std::string flags = CpuFlags();
  ASSERT_FALSE(flags.empty());
  const bool dot = flags.find(" avx512_vnni ") != std::string::npos ||
                   flags.find(" avx_vnni ") != std::string::npos ||
                   flags.find(" amx_int8 ") != std::string::npos;
  EXPECT_EQ(CpuHasInt8Dot(), dot);
  AttentionDims d = Dims(256, 4);
  const PackedWeights w = RandomWeights(d, 1);
  const int64_t fp32_bytes = MhaEngine::Create(d, w).value()->WeightBytes();
  d.int8 = true;
  const absl::StatusOr<std::unique_ptr<MhaEngine>> engine = MhaEngine::Create(d, w);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->dims().int8, dot);
  if (dot) {
    EXPECT_LT((*engine)->WeightBytes(), fp32_bytes / 3);
  } else {
    EXPECT_EQ((*engine)->WeightBytes(), fp32_bytes);
  }
}

// oneDNN 2.6 computes bf16 (natively or emulated) only from AVX-512 on:
// exactly then may a bf16 model compute in bf16.
TEST(EngineCpuTest, Bf16ComputeNeedsAvx512) {
  const std::string flags = CpuFlags();
  ASSERT_FALSE(flags.empty());
  const bool avx512 = flags.find(" avx512f ") != std::string::npos &&
                      flags.find(" avx512bw ") != std::string::npos &&
                      flags.find(" avx512vl ") != std::string::npos;
  EXPECT_EQ(CpuCanComputeBf16(), avx512);
  AttentionDims d = Dims(24, 3);
  d.bf16 = true;
  const absl::StatusOr<std::unique_ptr<MhaEngine>> engine =
      MhaEngine::Create(d, RandomWeights(d, 1));
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->dims().bf16, avx512);
}

}  // namespace
}  // namespace mha::testing
