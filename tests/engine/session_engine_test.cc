// Sessions in the engine: a self session fed in chunks equals one causal
// Run over the whole sequence; a cross session equals Run over its memory;
// the block pool keeps its budget.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/test_models.h"

namespace mha::testing {
namespace {

constexpr int64_t kPoolBytes = int64_t{64} << 20;

// Run over one whole sequence (causal for self-attention), with weights.
RunResult FullRun(const MhaEngine& engine, const Case& c, const Built& b) {
  return RunEngine(engine, c, b, /*with_weights=*/true);
}

// Feeds `query` ([len, E]) through a fresh self session in chunks of the
// given sizes (cycled), checking each chunk against `full`.
void ExpectChunkedMatchesFull(const MhaEngine& engine, const AttentionDims& d,
                              const std::vector<float>& query, const RunResult& full,
                              const std::vector<int64_t>& chunks, float tolerance = 1e-5f) {
  const int64_t e = d.embed_dim, len = static_cast<int64_t>(query.size()) / e;
  const int64_t keys_full = len + d.extra_keys();
  KvBlockPool pool(kPoolBytes);
  KvCache cache(engine.kv_layout(), pool);
  auto ws = engine.NewWorkspace();
  size_t next = 0;
  for (int64_t pos = 0; pos < len;) {
    const int64_t t = std::min(chunks[next++ % chunks.size()], len - pos);
    ASSERT_TRUE(cache.Reserve(pos + t).ok());
    StepBatch batch;
    batch.query = absl::MakeConstSpan(query).subspan(pos * e, t * e);
    batch.steps.push_back({&cache, t, /*cross=*/false});
    std::vector<float> out(t * e), weights(engine.StepWeightsElements(batch));
    ASSERT_TRUE(engine.Step(batch, {absl::MakeSpan(out), absl::MakeSpan(weights)}, *ws).ok());
    EXPECT_EQ(cache.length(), pos + t);
    EXPECT_LE(MaxAbsDiff(out.data(), full.output.data() + pos * e, out.size()), tolerance)
        << "chunk at " << pos << " of " << t << " tokens";
    // Weights: the chunk's keys are the full row's first pos + t columns,
    // then the appended positions (last in both).
    const int64_t keys = pos + t + d.extra_keys();
    for (int64_t r = 0; r < t; ++r) {
      const float* want = full.weights.data() + (pos + r) * keys_full;
      const float* got = weights.data() + r * keys;
      EXPECT_LE(MaxAbsDiff(got, want, pos + t), tolerance) << "row " << pos + r;
      EXPECT_LE(MaxAbsDiff(got + pos + t, want + len, d.extra_keys()), tolerance);
    }
    pos += t;
  }
}

struct SelfCase {
  const char* name;
  AttentionDims dims;
};
void PrintTo(const SelfCase& c, std::ostream* os) { *os << c.name; }

class SessionSelfTest : public ::testing::TestWithParam<SelfCase> {};

TEST_P(SessionSelfTest, ChunksOfAnySizeEqualOneCausalRun) {
  const AttentionDims d = GetParam().dims;
  const PackedWeights w = RandomWeights(d, 11);
  const auto engine = MakeEngine(d, w);
  // 70 tokens: crosses two block boundaries (32 tokens per block).
  const Case c{"causal", d, {70}, {}, false, MaskKind::kNone, MaskKind::kNone, true, true};
  const Built b = Build(c, 21);
  const RunResult full = FullRun(*engine, c, b);
  for (const std::vector<int64_t>& chunks :
       std::vector<std::vector<int64_t>>{{1}, {3}, {32}, {70}, {5, 1, 31, 2, 17}}) {
    SCOPED_TRACE(::testing::Message() << "first chunk " << chunks[0]);
    ExpectChunkedMatchesFull(*engine, d, b.query, full, chunks);
  }
}

// Sessions of `engine` with something cached: a self session (when the
// model has them) holding 5 tokens, and a cross session over 7 memory tokens.
std::vector<std::unique_ptr<KvCache>> CachedSessions(const MhaEngine& engine, KvBlockPool& pool,
                                                     Workspace& ws, uint32_t seed) {
  const AttentionDims& d = engine.dims();
  std::vector<std::unique_ptr<KvCache>> caches;
  if (engine.CanAppendSelf()) {
    caches.push_back(std::make_unique<KvCache>(engine.kv_layout(), pool));
    EXPECT_TRUE(caches.back()->Reserve(5 + 2).ok());
    const std::vector<float> prefix = RandomVector(5 * d.embed_dim, seed);
    std::vector<float> out(prefix.size());
    EXPECT_TRUE(
        engine.Step({prefix, {{caches.back().get(), 5}}}, {absl::MakeSpan(out), {}}, ws).ok());
  }
  caches.push_back(std::make_unique<KvCache>(engine.kv_layout(), pool));
  EXPECT_TRUE(caches.back()->Reserve(7).ok());
  const std::vector<float> memory = RandomVector(7 * d.kdim, seed + 1);
  const std::vector<float> value = RandomVector(7 * d.vdim, seed + 2);
  EXPECT_TRUE(engine.ProjectEncoderMemory(memory, value, 7, {}, *caches.back(), ws).ok());
  return caches;
}

// One engine call of Attend sequences (case `c`) and session steps (2
// tokens of the self session, 3 of the cross one) gives what each gives in
// a call of its own, weights included, and grows the self cache alike.
void ExpectMixedCallEqualsSeparateCalls(const AttentionDims& d, const Case& c, uint32_t seed,
                                        float tolerance = 1e-5f) {
  const auto engine = MakeEngine(d, RandomWeights(d, seed));
  auto ws = engine->NewWorkspace();
  const Built b = Build(c, seed + 1);
  const RunResult attend_alone = RunEngine(*engine, c, b, /*with_weights=*/true);
  KvBlockPool pool(kPoolBytes);
  auto mixed = CachedSessions(*engine, pool, *ws, seed + 2);
  auto alone = CachedSessions(*engine, pool, *ws, seed + 2);
  const int64_t e = d.embed_dim;
  std::vector<int64_t> tokens = {2, 3};
  if (!engine->CanAppendSelf()) tokens = {3};
  const int64_t step_rows = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
  const std::vector<float> q = RandomVector(step_rows * e, seed + 3);
  StepBatch steps{q, {}};
  for (size_t i = 0; i < tokens.size(); ++i) {
    steps.steps.push_back({mixed[i].get(), tokens[i], /*cross=*/i + 1 == tokens.size()});
  }
  const int64_t q_rows = b.batch.q_offsets.back();
  std::vector<float> output((q_rows + step_rows) * e);
  std::vector<float> weights(engine->WeightsElements(b.batch, c.per_head_weights));
  std::vector<float> step_weights(engine->StepWeightsElements(steps));
  ASSERT_TRUE(engine
                  ->Compute(b.batch, steps,
                            {absl::MakeSpan(output), absl::MakeSpan(weights), c.per_head_weights,
                             absl::MakeSpan(step_weights)},
                            *ws)
                  .ok());
  EXPECT_LE(MaxAbsDiff(output.data(), attend_alone.output.data(), q_rows * e), tolerance);
  EXPECT_LE(MaxAbsDiff(weights.data(), attend_alone.weights.data(), weights.size()), tolerance);
  int64_t row = 0, w_off = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    StepBatch one{absl::MakeConstSpan(q).subspan(row * e, tokens[i] * e),
                  {{alone[i].get(), tokens[i], steps.steps[i].cross}}};
    std::vector<float> out(tokens[i] * e), w(engine->StepWeightsElements(one));
    ASSERT_TRUE(engine->Step(one, {absl::MakeSpan(out), absl::MakeSpan(w)}, *ws).ok());
    EXPECT_LE(MaxAbsDiff(out.data(), output.data() + (q_rows + row) * e, out.size()), tolerance)
        << "step " << i;
    EXPECT_LE(MaxAbsDiff(w.data(), step_weights.data() + w_off, w.size()), tolerance)
        << "step " << i;
    EXPECT_EQ(mixed[i]->length(), alone[i]->length());
    row += tokens[i];
    w_off += static_cast<int64_t>(w.size());
  }
}

TEST_P(SessionSelfTest, StepsShareOneCallWithAttendSequences) {
  const AttentionDims d = GetParam().dims;
  // Self-attention sequences: one q|k|v product over their rows and the steps'.
  ExpectMixedCallEqualsSeparateCalls(
      d, Case{"self", d, {6, 1, 9}, {}, false, MaskKind::kBool, MaskKind::kFloat}, 31);
}

TEST(SessionMixedTest, CrossSequencesWithSelfStepsProjectApart) {
  const AttentionDims d = Dims(24, 3);
  ExpectMixedCallEqualsSeparateCalls(d, Case{"cross", d, {4, 2}, {9, 33}, false, MaskKind::kBool},
                                     41);
}

TEST(SessionMixedTest, CrossSequencesWithCrossStepsShareTheQueryProduct) {
  const AttentionDims d =
      With(Dims(24, 3), [](AttentionDims& x) { x.kdim = 16, x.vdim = 20, x.add_bias_kv = true; });
  ExpectMixedCallEqualsSeparateCalls(d, Case{"cross", d, {3, 5}, {8, 2}}, 51);
}

INSTANTIATE_TEST_SUITE_P(
    Options, SessionSelfTest,
    ::testing::Values(
        SelfCase{"plain", Dims(24, 3)},
        SelfCase{"no_bias", With(Dims(24, 3), [](AttentionDims& d) { d.bias = false; })},
        SelfCase{"bias_kv", With(Dims(24, 3), [](AttentionDims& d) { d.add_bias_kv = true; })},
        SelfCase{"zero_attn", With(Dims(24, 3), [](AttentionDims& d) { d.add_zero_attn = true; })},
        SelfCase{"both_extra", With(Dims(24, 3),
                                    [](AttentionDims& d) {
                                      d.add_bias_kv = true;
                                      d.add_zero_attn = true;
                                    })},
        SelfCase{"post_norm", With(Dims(24, 3), [](AttentionDims& d) { d.post_norm = true; })},
        SelfCase{"head_dims", With(Dims(32, 4),
                                   [](AttentionDims& d) {
                                     d.qk_head_dim = 6;
                                     d.v_head_dim = 10;
                                   })}),
    [](const auto& info) { return std::string(info.param.name); });

// A bf16 model's sessions: bf16 caches and loops where the CPU computes in
// bf16 (AVX-512), within bf16's tolerance of Run's oneDNN bf16 products;
// where it cannot, the model computes in fp32 (then to 1e-5).
void ExpectBf16SessionsWithinTolerance(const AttentionDims& d);

// A causal sequence of 70 tokens (seed 21 for its inputs).
Case Causal70(const AttentionDims& d) {
  return Case{"causal", d, {70}, {}, false, MaskKind::kNone, MaskKind::kNone, true, true};
}

// `engine`'s (of dims `d`) steps within `tolerance` of one full Run: a
// causal sequence of 70 fed one token at a time and in uneven chunks, and
// calls mixing steps of several sessions. Returns the full Run.
RunResult ExpectStepsWithin(const MhaEngine& engine, const AttentionDims& d, float tolerance) {
  const Case c = Causal70(d);
  const Built b = Build(c, 21);
  RunResult full = FullRun(engine, c, b);
  for (const std::vector<int64_t>& chunks :
       std::vector<std::vector<int64_t>>{{1}, {5, 1, 31, 2, 17}}) {
    ExpectChunkedMatchesFull(engine, engine.dims(), b.query, full, chunks, tolerance);
  }
  ExpectMixedCallEqualsSeparateCalls(
      d, Case{"self", d, {6, 1, 9}, {}, false, MaskKind::kBool, MaskKind::kFloat}, 31, tolerance);
  return full;
}

TEST(SessionBf16Test, ChunksAndMixedCallsStayWithinBf16Tolerance) {
  ExpectBf16SessionsWithinTolerance(With(Dims(24, 3), [](AttentionDims& x) { x.bf16 = true; }));
  // Heads of 64 (the step loops' 64-column path, its split bf16 sums) with
  // bias_kv and zero_attn (the bias value added after the split sums merge).
  ExpectBf16SessionsWithinTolerance(With(Dims(128, 2), [](AttentionDims& x) {
    x.bf16 = true, x.add_bias_kv = true, x.add_zero_attn = true;
  }));
}

void ExpectBf16SessionsWithinTolerance(const AttentionDims& d) {
  const auto engine = MakeEngine(d, RandomWeights(d, 11));
  EXPECT_EQ(engine->dims().bf16, CpuCanComputeBf16());
  const float tolerance = engine->dims().bf16 ? 3e-2f : 1e-5f;
  EXPECT_EQ(engine->kv_layout().elem_bytes, engine->dims().bf16 ? 2 : 4);
  ExpectStepsWithin(*engine, d, tolerance);
}

// An int8 model's sessions (int8 projections of each step's rows, the
// core in bf16 where native), with each cache type it may have: steps
// within 2e-2 of one full Run of the same engine (a row's quantization does
// not depend on the rows beside it, so only the core's rounding differs).
TEST(SessionInt8Test, StepsOfInt8ProjectionsStayWithinTolerance) {
  for (const char* cache : {"compute", "bf16", "int8", "fp32"}) {
    SCOPED_TRACE(cache);
    AttentionDims d = With(Dims(64, 4), [](AttentionDims& x) { x.add_bias_kv = true; });
    d.int8 = true;
    d.bf16 = std::string(cache) != "fp32";  // as ResolveDims sets it
    d.kv_cache_bf16 = std::string(cache) == "bf16";
    d.kv_cache_int8 = std::string(cache) == "int8";
    const auto engine = MakeEngine(d, RandomWeights(d, 13));
    EXPECT_EQ(engine->dims().int8, CpuHasInt8Dot());
    ExpectStepsWithin(*engine, d, std::string(cache) == "int8" ? 6e-2f : 2e-2f);
  }
}

// An fp32 model with a bf16 cache (kv_cache_dtype BF16): half the bytes
// on every CPU, its keys and values rounded to bf16 as written, so the
// steps stay within bf16's rounding of Run's fp32 pass (measured: up to
// 3.3e-4 on this model; the bound leaves 6x), for self chunks and calls
// mixing self and cross steps.
void ExpectBf16CacheWithinRounding(const AttentionDims& fp32_dims);

TEST(SessionBf16CacheTest, AnFp32ModelsBf16CacheStaysWithinBf16Rounding) {
  ExpectBf16CacheWithinRounding(Dims(24, 3));
  // Heads of 64 (the 64-column path) with bias_kv and zero_attn.
  ExpectBf16CacheWithinRounding(
      With(Dims(128, 2), [](AttentionDims& x) { x.add_bias_kv = true, x.add_zero_attn = true; }));
}

void ExpectBf16CacheWithinRounding(const AttentionDims& fp32_dims) {
  AttentionDims d = fp32_dims;
  d.kv_cache_bf16 = true;
  const auto engine = MakeEngine(d, RandomWeights(d, 11));
  EXPECT_FALSE(engine->dims().bf16);
  EXPECT_EQ(engine->kv_layout().elem_bytes, 2);
  EXPECT_EQ(engine->kv_layout().block_bytes() * 2,
            MakeEngine(fp32_dims, RandomWeights(d, 11))->kv_layout().block_bytes());
  constexpr float kTolerance = 2e-3f;
  const RunResult full = ExpectStepsWithin(*engine, d, kTolerance);
  // Attend (Run) keeps the model's fp32 numbers: only sessions round.
  const auto fp32 = MakeEngine(fp32_dims, RandomWeights(d, 11));
  const RunResult exact = FullRun(*fp32, Causal70(d), Build(Causal70(d), 21));
  EXPECT_LE(MaxAbsDiff(full.output.data(), exact.output.data(), full.output.size()), 1e-6f);
}

// kv_cache_dtype INT8: a quarter of an fp32 cache's element bytes plus an
// f32 scale per token and head, keys and values rounded to int8 of their
// row's largest magnitude as written. Self chunks and cross steps stay
// within the rounding of Run's fp32 pass (measured on these models: see
// kInt8Tolerance), for fp32 and bf16 compute; steps in one call with
// Attend sequences equal steps alone (the same rounding).
constexpr float kInt8Tolerance = 2e-2f;

float Int8StepsAgainstFp32(const AttentionDims& fp32_dims, bool bf16_compute) {
  AttentionDims d = fp32_dims;
  d.kv_cache_int8 = true;
  d.bf16 = bf16_compute;
  const PackedWeights w = RandomWeights(d, 11);
  const auto engine = MakeEngine(d, w);
  const KvLayout layout = engine->kv_layout();
  EXPECT_TRUE(layout.int8());
  EXPECT_EQ(layout.block_bytes(),
            d.num_heads * KvLayout::kBlockTokens *
                (d.qk_head_dim + d.v_head_dim + 2 * static_cast<int64_t>(sizeof(float))));
  const auto fp32 = MakeEngine(fp32_dims, w);
  float worst = 0.0f;
  // Self: chunks of a causal pass against the fp32 model's whole pass.
  const Case c{"causal", d, {70}, {}, false, MaskKind::kNone, MaskKind::kNone, true, true};
  const Built b = Build(c, 21);
  const RunResult exact = FullRun(*fp32, c, b);
  for (const int64_t chunk : {int64_t{1}, int64_t{17}}) {
    KvBlockPool pool(kPoolBytes);
    KvCache cache(layout, pool);
    auto ws = engine->NewWorkspace();
    const int64_t e = d.embed_dim;
    for (int64_t pos = 0; pos < 70; pos += chunk) {
      const int64_t t = std::min<int64_t>(chunk, 70 - pos);
      EXPECT_TRUE(cache.Reserve(pos + t).ok());
      StepBatch batch{absl::MakeConstSpan(b.query).subspan(pos * e, t * e),
                      {{&cache, t, /*cross=*/false}}};
      std::vector<float> out(t * e);
      EXPECT_TRUE(engine->Step(batch, {absl::MakeSpan(out), {}}, *ws).ok());
      worst = std::max(worst, MaxAbsDiff(out.data(), exact.output.data() + pos * e, out.size()));
    }
  }
  // Cross: steps over a projected memory against Run over it.
  if (d.kdim == d.vdim) {
    const int64_t len = 5, mem = 45;
    const Case x{"cross", d, {len}, {mem}, false, MaskKind::kBool};
    const Built xb = Build(x, 8);
    const RunResult want = RunEngine(*fp32, x, xb);
    KvBlockPool pool(kPoolBytes);
    KvCache cache(layout, pool);
    auto ws = engine->NewWorkspace();
    EXPECT_TRUE(cache.Reserve(mem).ok());
    EXPECT_TRUE(
        engine->ProjectEncoderMemory(xb.key, xb.value, mem, xb.batch.key_padding_mask, cache, *ws)
            .ok());
    StepBatch batch{xb.query, {{&cache, len, /*cross=*/true}}};
    std::vector<float> out(len * d.embed_dim);
    EXPECT_TRUE(engine->Step(batch, {absl::MakeSpan(out), {}}, *ws).ok());
    worst = std::max(worst, MaxAbsDiff(out.data(), want.output.data(), out.size()));
  }
  ExpectMixedCallEqualsSeparateCalls(
      d, Case{"self", d, {6, 1, 9}, {}, false, MaskKind::kBool, MaskKind::kFloat}, 31);
  return worst;
}

TEST(SessionInt8CacheTest, StepsStayWithinInt8RoundingOfTheFp32Pass) {
  const AttentionDims models[] = {
      Dims(24, 3),
      // Heads of 64 (the 64-column loops) with bias_kv and zero_attn.
      With(Dims(128, 2), [](AttentionDims& x) { x.add_bias_kv = true, x.add_zero_attn = true; }),
      With(Dims(32, 4), [](AttentionDims& x) { x.post_norm = true; })};
  for (const AttentionDims& d : models) {
    for (const bool bf16 : {false, true}) {
      const float worst = Int8StepsAgainstFp32(d, bf16);
      std::printf("int8 cache, E %ld h %ld%s: max |step - fp32 pass| %.2e\n",
                  static_cast<long>(d.embed_dim), static_cast<long>(d.num_heads),
                  bf16 ? ", bf16 compute" : "", worst);
      EXPECT_LE(worst, kInt8Tolerance) << d.embed_dim << (bf16 ? " bf16" : "");
    }
  }
}

// A cross session's step equals Run with key = memory (and its value and
// padding mask), for every chunking of the queries.
TEST(SessionCrossTest, StepsEqualRunOverTheMemory) {
  const AttentionDims d = With(Dims(24, 3), [](AttentionDims& x) {
    x.kdim = 16, x.vdim = 20, x.add_bias_kv = true, x.add_zero_attn = true;
  });
  const PackedWeights w = RandomWeights(d, 5);
  const auto engine = MakeEngine(d, w);
  const int64_t len = 9, mem = 45;
  Case c{"cross", d, {len}, {mem}, false, MaskKind::kBool};
  const Built b = Build(c, 8);
  const RunResult full = RunEngine(*engine, c, b);
  KvBlockPool pool(kPoolBytes);
  KvCache cache(engine->kv_layout(), pool);
  auto ws = engine->NewWorkspace();
  ASSERT_TRUE(cache.Reserve(mem).ok());
  MaskView padding = b.batch.key_padding_mask;
  ASSERT_TRUE(engine->ProjectEncoderMemory(b.key, b.value, mem, padding, cache, *ws).ok());
  EXPECT_EQ(cache.length(), mem);
  const int64_t e = d.embed_dim, keys = mem + d.extra_keys();
  for (int64_t pos = 0; pos < len;) {
    const int64_t t = std::min<int64_t>(pos == 0 ? 1 : 4, len - pos);
    StepBatch batch;
    batch.query = absl::MakeConstSpan(b.query).subspan(pos * e, t * e);
    batch.steps.push_back({&cache, t, /*cross=*/true});
    std::vector<float> out(t * e), weights(engine->StepWeightsElements(batch));
    ASSERT_EQ(static_cast<int64_t>(weights.size()), t * keys);
    ASSERT_TRUE(engine->Step(batch, {absl::MakeSpan(out), absl::MakeSpan(weights)}, *ws).ok());
    EXPECT_EQ(cache.length(), mem) << "a cross step appends nothing";
    EXPECT_LE(MaxAbsDiff(out.data(), full.output.data() + pos * e, out.size()), 1e-5f);
    EXPECT_LE(MaxAbsDiff(weights.data(), full.weights.data() + pos * keys, weights.size()), 1e-5f);
    pos += t;
  }
}

TEST(SessionCrossTest, FullyPaddedMemoryGivesTheOutputBias) {
  const AttentionDims d = Dims(24, 3);
  const PackedWeights w = RandomWeights(d, 5);
  const auto engine = MakeEngine(d, w);
  KvBlockPool pool(kPoolBytes);
  KvCache cache(engine->kv_layout(), pool);
  auto ws = engine->NewWorkspace();
  const std::vector<float> memory = RandomVector(5 * 24, 3);
  const std::vector<uint8_t> all_masked(5, 1);
  ASSERT_TRUE(cache.Reserve(5).ok());
  ASSERT_TRUE(
      engine->ProjectEncoderMemory(memory, {}, 5, {DType::kBool, all_masked.data(), 5}, cache, *ws)
          .ok());
  const std::vector<float> query = RandomVector(24, 4);
  StepBatch batch{query, {{&cache, 1, true}}};
  std::vector<float> out(24);
  ASSERT_TRUE(engine->Step(batch, {absl::MakeSpan(out), {}}, *ws).ok());
  EXPECT_LE(MaxAbsDiff(out.data(), w.b_o.data(), 24), 1e-6f);
}

// Steps of several sessions in one call give what each gives alone.
TEST(SessionBatchTest, OneCallForManySessionsEqualsOneCallEach) {
  const AttentionDims d = Dims(32, 4);
  const PackedWeights w = RandomWeights(d, 2);
  const auto engine = MakeEngine(d, w);
  auto ws = engine->NewWorkspace();
  KvBlockPool pool(kPoolBytes);
  const std::vector<int64_t> prefix = {1, 40, 7, 64}, step = {1, 3, 1, 2};
  std::vector<std::unique_ptr<KvCache>> batched, alone;
  for (size_t s = 0; s < prefix.size(); ++s) {
    for (auto* set : {&batched, &alone}) {
      set->push_back(std::make_unique<KvCache>(engine->kv_layout(), pool));
      KvCache& cache = *set->back();
      ASSERT_TRUE(cache.Reserve(prefix[s] + step[s]).ok());
      const std::vector<float> q = RandomVector(prefix[s] * 32, 30 + s);
      std::vector<float> out(q.size());
      ASSERT_TRUE(
          engine->Step({q, {{&cache, prefix[s], false}}}, {absl::MakeSpan(out), {}}, *ws).ok());
    }
  }
  const int64_t total = std::accumulate(step.begin(), step.end(), int64_t{0});
  const std::vector<float> q = RandomVector(total * 32, 99);
  StepBatch batch{q, {}};
  for (size_t s = 0; s < prefix.size(); ++s) batch.steps.push_back({batched[s].get(), step[s]});
  std::vector<float> together(q.size());
  ASSERT_TRUE(engine->Step(batch, {absl::MakeSpan(together), {}}, *ws).ok());
  int64_t row = 0;
  for (size_t s = 0; s < prefix.size(); ++s) {
    std::vector<float> out(step[s] * 32);
    const auto part = absl::MakeConstSpan(q).subspan(row * 32, step[s] * 32);
    ASSERT_TRUE(
        engine->Step({part, {{alone[s].get(), step[s]}}}, {absl::MakeSpan(out), {}}, *ws).ok());
    EXPECT_LE(MaxAbsDiff(out.data(), together.data() + row * 32, out.size()), 1e-6f)
        << "session " << s;
    row += step[s];
  }
}

// A workspace's yield point (Workspace::set_between_blocks): a long call
// calls it between its parts (after the projection, between attention
// blocks, between waves of key-tiled blocks), and a session step computed
// there on another workspace, while the long call is half done, changes
// neither result. A call of steps alone never yields.
TEST(SessionYieldTest, StepsRunBetweenALongCallsBlocksChangeNeitherResult) {
  const AttentionDims d = Dims(32, 4);
  const PackedWeights w = RandomWeights(d, 5);
  EngineOptions small_blocks;
  small_blocks.max_score_bytes = 64 << 10;  // L = 300 with weights: many row blocks
  EngineOptions small_waves;
  small_waves.yield_wave_flops = 1;  // one key-tiled block a thread a wave
  struct LongCall {
    const char* name;
    Case c;
    bool weights;  // asked for: never key-tiled
    EngineOptions options;
  };
  const std::vector<LongCall> calls = {
      {"key-tiled", Case{"tiled", d, {700}, {}}, false, small_waves},
      {"row blocks", Case{"blocks", d, {300}, {}, false, MaskKind::kBool}, true, small_blocks},
  };
  for (const LongCall& call : calls) {
    SCOPED_TRACE(call.name);
    const auto engine = MakeEngine(d, w, call.options);
    const Built b = Build(call.c, 6);
    const RunResult whole = RunEngine(*engine, call.c, b, call.weights);
    // Two copies of a session of 40 tokens: one steps inside the long
    // call's yield, the other alone.
    KvBlockPool pool(kPoolBytes);
    auto ws = engine->NewWorkspace(), step_ws = engine->NewWorkspace();
    std::vector<std::unique_ptr<KvCache>> caches;
    const std::vector<float> prefix = RandomVector(40 * 32, 7), q = RandomVector(32, 8);
    for (int i = 0; i < 2; ++i) {
      caches.push_back(std::make_unique<KvCache>(engine->kv_layout(), pool));
      ASSERT_TRUE(caches.back()->Reserve(41).ok());
      std::vector<float> out(prefix.size());
      ASSERT_TRUE(
          engine->Step({prefix, {{caches.back().get(), 40}}}, {absl::MakeSpan(out), {}}, *step_ws)
              .ok());
    }
    std::vector<float> stepped(32), alone(32);
    int yields = 0;
    ws->set_between_blocks([&] {
      if (++yields != 2) return true;  // the second yield: the attention has begun
      EXPECT_TRUE(
          engine->Step({q, {{caches[0].get(), 1}}}, {absl::MakeSpan(stepped), {}}, *step_ws).ok());
      return true;
    });
    const RunResult yielded = RunEngine(*engine, call.c, b, call.weights, ws.get());
    EXPECT_GE(yields, 3);
    EXPECT_EQ(caches[0]->length(), 41);
    EXPECT_EQ(MaxAbsDiff(yielded.output.data(), whole.output.data(), whole.output.size()), 0.0f);
    EXPECT_EQ(MaxAbsDiff(yielded.weights.data(), whole.weights.data(), whole.weights.size()), 0.0f);
    ASSERT_TRUE(
        engine->Step({q, {{caches[1].get(), 1}}}, {absl::MakeSpan(alone), {}}, *step_ws).ok());
    EXPECT_EQ(MaxAbsDiff(stepped.data(), alone.data(), alone.size()), 0.0f);
    // Steps alone: no yield.
    const int before = yields;
    ASSERT_TRUE(caches[1]->Reserve(42).ok());
    ASSERT_TRUE(engine->Step({q, {{caches[1].get(), 1}}}, {absl::MakeSpan(alone), {}}, *ws).ok());
    EXPECT_EQ(yields, before);
    // A yield point that wants no more: the key-tiled blocks go in one
    // wave (one yield after the projection, one after that wave); row
    // blocks still pass theirs. Same result.
    int unwanted = 0;
    ws->set_between_blocks([&] {
      ++unwanted;
      return false;
    });
    const RunResult one_go = RunEngine(*engine, call.c, b, call.weights, ws.get());
    EXPECT_EQ(unwanted, call.weights ? yields : 2);
    EXPECT_EQ(MaxAbsDiff(one_go.output.data(), whole.output.data(), whole.output.size()), 0.0f);
  }
}

TEST(SessionValidationTest, RefusesWhatItCannotCompute) {
  const AttentionDims cross = With(Dims(24, 3), [](AttentionDims& x) { x.kdim = 16; });
  const auto cross_engine = MakeEngine(cross, RandomWeights(cross, 1));
  const auto engine = MakeEngine(Dims(24, 3), RandomWeights(Dims(24, 3), 1));
  auto ws = engine->NewWorkspace();
  KvBlockPool pool(kPoolBytes);
  KvCache cache(engine->kv_layout(), pool);
  const std::vector<float> q = RandomVector(2 * 24, 1);
  std::vector<float> out(q.size());
  // No room reserved.
  EXPECT_EQ(engine->Step({q, {{&cache, 2}}}, {absl::MakeSpan(out), {}}, *ws).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache.Reserve(2).ok());
  // The same cache twice.
  EXPECT_EQ(engine->Step({q, {{&cache, 1}, {&cache, 1}}}, {absl::MakeSpan(out), {}}, *ws).code(),
            absl::StatusCode::kInvalidArgument);
  // A self step on a model whose keys are not its queries.
  EXPECT_FALSE(cross_engine->CanAppendSelf());
  KvCache cross_cache(cross_engine->kv_layout(), pool);
  ASSERT_TRUE(cross_cache.Reserve(2).ok());
  const absl::Status self_on_cross =
      cross_engine->Step({q, {{&cross_cache, 2}}}, {absl::MakeSpan(out), {}}, *ws);
  EXPECT_EQ(self_on_cross.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(self_on_cross.message().find("kdim == vdim == embed_dim"), std::string::npos);
  // The memory must match kdim.
  KvCache mem(cross_engine->kv_layout(), pool);
  ASSERT_TRUE(mem.Reserve(3).ok());
  EXPECT_EQ(cross_engine->ProjectEncoderMemory(RandomVector(3 * 24, 2), {}, 3, {}, mem, *ws).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.length(), 0) << "a refused step changes nothing";
}

}  // namespace
}  // namespace mha::testing
