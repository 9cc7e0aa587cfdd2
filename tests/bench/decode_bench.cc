#include "tests/bench/decode_bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "engine/kv_cache.h"
#include "engine/mha_engine.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

constexpr int64_t kE = 512, kHeads = 8;

// Median seconds of `reps` calls of `fn` after two warm-up calls.
template <typename Fn>
double MedianOf(int reps, Fn&& fn) {
  fn();
  fn();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[reps / 2];
}

// The fastest of `reps` calls of `fn` after one warm-up call, seconds.
template <typename Fn>
double FastestOf(int reps, Fn&& fn) {
  fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "mha_bench --decode: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// Fills `cache` with `len` tokens, 512 per call.
void Prefill(const MhaEngine& engine, KvCache& cache, int64_t len, Workspace& ws) {
  Check(cache.Reserve(len + 1));
  for (int64_t pos = 0; pos < len; pos += 512) {
    const int64_t t = std::min<int64_t>(512, len - pos);
    const std::vector<float> x = testing::RandomVector(t * kE, static_cast<uint32_t>(pos + 1));
    std::vector<float> out(x.size());
    Check(engine.Step({x, {{&cache, t}}}, {absl::MakeSpan(out), {}}, ws));
  }
}

// A decode step's physical limit: the machine's memory read bandwidth,
// measured as a streaming sum over 256 MiB (far above any L3) with the
// engine's OpenMP threads, in the same run as the steps. The best of 7,
// GB/s: a shared machine's neighbours only ever slow a pass, and a median
// of passes they slowed made the steps read at 130-180 % "of the limit".
double ProbeReadBandwidth() {
  constexpr int64_t kFloats = int64_t{64} << 20;  // 256 MiB
  std::vector<float> data(kFloats);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < kFloats; ++i) data[i] = static_cast<float>(i & 7);  // each thread's pages
  volatile float sink = 0;
  const double s = FastestOf(7, [&] {
    float sum = 0;
    // 32 independent partial sums per thread: the adds' latency must not
    // be what limits the read (one running sum reads ~16 GB/s here).
    constexpr int kLanes = 32;
#pragma omp parallel reduction(+ : sum)
    {
      float lanes[kLanes] = {};
#pragma omp for schedule(static)
      for (int64_t b = 0; b < kFloats / kLanes; ++b) {
        for (int j = 0; j < kLanes; ++j) lanes[j] += data[b * kLanes + j];
      }
      for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    }
    sink = sink + sum;
  });
  return static_cast<double>(kFloats) * sizeof(float) / s / 1e9;
}

// The keys and values a step of one token reads from a cache of `cached`
// tokens (E = 512 for both; 4-byte elements, or 2 in a bf16 cache).
// The cache bytes a step reads: `token_bytes` per cached token (keys and
// values; an int8 cache's scales included).
double KvBytes(int64_t sessions, int64_t cached, double token_bytes = 2 * kE * 4) {
  return static_cast<double>(sessions) * cached * token_bytes;
}

// The probe's rate for this run (ProbeReadBandwidth, set by BenchDecode).
double probe_gb_per_s = 0;

void Print(bool json, const char* name, double ms, const char* what, double ratio, double target,
           double kv_bytes = 0) {
  const double gb_per_s = kv_bytes > 0 ? kv_bytes / (ms * 1e-3) / 1e9 : 0;
  if (json) {
    std::printf("{\"name\": \"%s\", \"ms\": %.4f, \"%s\": %.2f, \"target\": %g", name, ms, what,
                ratio, target);
    if (kv_bytes > 0) {
      std::printf(
          ", \"kv_bytes\": %.0f, \"kv_gb_per_s\": %.2f, \"probe_gb_per_s\": %.2f, "
          "\"of_probe\": %.3f",
          kv_bytes, gb_per_s, probe_gb_per_s, gb_per_s / probe_gb_per_s);
    }
    std::printf("}\n");
  } else {
    std::printf("%-34s %10.4f ms   %s %.2fx (target >= %gx)", name, ms, what, ratio, target);
    if (kv_bytes > 0) {
      std::printf("   K/V %.1f MiB at %.1f GB/s, %.0f %% of the probe", kv_bytes / (1 << 20),
                  gb_per_s, 100 * gb_per_s / probe_gb_per_s);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

// Medians of `fns`' seconds, taken in alternation: round after round,
// each fn once, after two warm-up rounds. On a shared machine the noise
// then falls on every fn alike, and their ratios hold.
std::vector<double> AlternatedMedians(int rounds, const std::vector<std::function<void()>>& fns) {
  std::vector<std::vector<double>> times(fns.size());
  for (int round = -2; round < rounds; ++round) {
    for (size_t f = 0; f < fns.size(); ++f) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[f]();
      const auto t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0);
      if (round >= 0) times[f].push_back(t.count());
    }
  }
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::nth_element(t.begin(), t.begin() + rounds / 2, t.end());
    medians.push_back(t[rounds / 2]);
  }
  return medians;
}

// 64 sessions at `cached` tokens each over one engine's cache, stepping 1
// token each: in one batched call, or in one call each. Each call rewinds
// the caches after it, so every call does the same work.
class BatchedSteps {
 public:
  static constexpr int64_t kSessions = 64;

  BatchedSteps(const MhaEngine& engine, KvBlockPool& pool, int64_t cached, Workspace& ws)
      : engine_(engine),
        ws_(ws),
        cached_(cached),
        tokens_(testing::RandomVector(kSessions * kE, 9)),
        out_(tokens_.size()) {
    batched_.query = tokens_;
    for (int64_t s = 0; s < kSessions; ++s) {
      caches_.push_back(std::make_unique<KvCache>(engine.kv_layout(), pool));
      Prefill(engine, *caches_.back(), cached, ws);
      batched_.steps.push_back({caches_.back().get(), 1});
    }
  }

  void Batched() {
    Check(engine_.Step(batched_, {absl::MakeSpan(out_), {}}, ws_));
    Rewind();
  }
  void OneCallEach() {
    for (int64_t s = 0; s < kSessions; ++s) {
      const auto q = absl::MakeConstSpan(tokens_).subspan(s * kE, kE);
      Check(engine_.Step({q, {{caches_[s].get(), 1}}},
                         {absl::MakeSpan(out_).subspan(s * kE, kE), {}}, ws_));
    }
    Rewind();
  }

  // Prints the two rows (seconds of each), named after the cache's dtype.
  void Print(bool json, double batched_s, double one_call_each_s) const {
    const KvLayout layout = engine_.kv_layout();
    const double token_bytes =
        static_cast<double>(layout.block_bytes()) / static_cast<double>(KvLayout::kBlockTokens);
    const std::string name = absl::StrFormat("decode_64x1_at%d%s", cached_,
                                             layout.int8()            ? "_int8cache"
                                             : layout.elem_bytes == 2 ? "_bf16cache"
                                                                      : "");
    const double kv_bytes = KvBytes(kSessions, cached_, token_bytes);
    mha::Print(json, (name + "_batched").c_str(), batched_s * 1e3, "tokens_per_s_ratio",
               one_call_each_s / batched_s, 8, kv_bytes);
    mha::Print(json, (name + "_one_call_each").c_str(), one_call_each_s * 1e3, "ratio", 1.0, 1,
               kv_bytes);
  }

 private:
  void Rewind() {
    for (auto& c : caches_) c->set_length(cached_);
  }

  const MhaEngine& engine_;
  Workspace& ws_;
  const int64_t cached_;
  const std::vector<float> tokens_;
  std::vector<float> out_;
  std::vector<std::unique_ptr<KvCache>> caches_;
  StepBatch batched_;
};

// 16 sessions' steps (1 token at 256 cached) riding along in an Attend
// call of `sequences` self-attention sequences of `len` tokens, against the
// same work as an Attend call and an Append call.
void BenchMixedCall(const MhaEngine& engine, KvBlockPool& pool, int64_t sequences, int64_t len,
                    bool json, Workspace& ws) {
  constexpr int64_t kSessions = 16, kCached = 256;
  std::vector<std::unique_ptr<KvCache>> caches;
  for (int64_t s = 0; s < kSessions; ++s) {
    caches.push_back(std::make_unique<KvCache>(engine.kv_layout(), pool));
    Prefill(engine, *caches.back(), kCached, ws);
  }
  // The steps' rows right after the sequences', as the batcher lays them out.
  const std::vector<float> rows = testing::RandomVector((sequences * len + kSessions) * kE, 11);
  const auto query = absl::MakeConstSpan(rows).first(sequences * len * kE);
  StepBatch steps{absl::MakeConstSpan(rows).subspan(query.size()), {}};
  for (auto& c : caches) steps.steps.push_back({c.get(), 1});
  AttentionBatch attend;
  attend.query = query;
  for (int64_t b = 0; b <= sequences; ++b) attend.q_offsets.push_back(b * len);
  std::vector<float> out(rows.size());
  const auto attend_out = absl::MakeSpan(out).subspan(0, query.size());
  const auto steps_out = absl::MakeSpan(out).subspan(query.size());
  auto rewind = [&] {
    for (auto& c : caches) c->set_length(kCached);
  };
  const double mixed_s = MedianOf(20, [&] {
    Check(engine.Compute(attend, steps, {absl::MakeSpan(out), {}, false, {}}, ws));
    rewind();
  });
  const double apart_s = MedianOf(20, [&] {
    Check(engine.Run(attend, {attend_out, {}, false}, ws));
    Check(engine.Step(steps, {steps_out, {}}, ws));
    rewind();
  });
  const std::string name = absl::StrFormat("mixed_attend%dx%d_steps16x1_at256", sequences, len);
  Print(json, name.c_str(), mixed_s * 1e3, "two_calls_over_one", apart_s / mixed_s, 1);
  Print(json, (name + "_as_two_calls").c_str(), apart_s * 1e3, "ratio", 1.0, 1);
}

}  // namespace

void BenchDecode(bool json) {
  const AttentionDims d = testing::MakeDims(kE, kHeads);
  auto created = MhaEngine::Create(d, testing::RandomWeights(d, 1));
  Check(created.status());
  const MhaEngine& engine = **created;
  auto ws = engine.NewWorkspace();
  KvBlockPool pool(int64_t{2} << 30);
  probe_gb_per_s = ProbeReadBandwidth();
  if (json) {
    std::printf("{\"name\": \"read_bandwidth_probe\", \"gb_per_s\": %.2f, \"threads\": %d}\n",
                probe_gb_per_s, omp_get_max_threads());
  } else {
    std::printf("%-34s %10.1f GB/s  (streaming sum of 256 MiB, %d threads)\n",
                "read_bandwidth_probe", probe_gb_per_s, omp_get_max_threads());
  }

  // One token at cached length 4096 against a causal pass over 4097. One
  // session's 16 MiB of keys and values fit a 32 MiB L3, so the steps
  // rotate over sessions holding 64 MiB in all: each step reads memory, as
  // a server's steps of many sessions do. The same session again and
  // again (L3-resident) is the second row.
  constexpr int64_t kLong = 4096, kRotate = 4;
  std::vector<std::unique_ptr<KvCache>> caches;
  for (int64_t i = 0; i < kRotate; ++i) {
    caches.push_back(std::make_unique<KvCache>(engine.kv_layout(), pool));
    Prefill(engine, *caches.back(), kLong, *ws);
  }
  const std::vector<float> token = testing::RandomVector(kE, 7);
  std::vector<float> token_out(kE);
  int64_t turn = 0;
  auto step_on = [&](KvCache& cache) {
    Check(engine.Step({token, {{&cache, 1}}}, {absl::MakeSpan(token_out), {}}, *ws));
    cache.set_length(kLong);  // the same step again
  };
  const double append_s = MedianOf(50, [&] { step_on(*caches[turn++ % kRotate]); });
  const double resident_s = MedianOf(50, [&] { step_on(*caches[0]); });
  const std::vector<float> sequence = testing::RandomVector((kLong + 1) * kE, 8);
  std::vector<float> sequence_out(sequence.size());
  AttentionBatch full;
  full.query = sequence;
  full.q_offsets = {0, kLong + 1};
  full.is_causal = true;
  const double full_s = MedianOf(5, [&] {
    Check(engine.Run(full, {absl::MakeSpan(sequence_out), {}, false}, *ws));
  });
  Print(json, "decode_append1_at4096", append_s * 1e3, "attend_causal_4097_over_append",
        full_s / append_s, 100, KvBytes(1, kLong));
  Print(json, "decode_append1_at4096_l3_resident", resident_s * 1e3,
        "attend_causal_4097_over_append", full_s / resident_s, 100, KvBytes(1, kLong));
  Print(json, "decode_attend_causal_4097", full_s * 1e3, "ratio", 1.0, 1);

  // 64 sessions appending 1 token each: one batched call against 64 calls.
  // At cached length 64 the cache reads are small and what batching saves
  // (per-call cost, weight reads) shows alone.
  {
    BatchedSteps at64(engine, pool, 64, *ws);
    const std::vector<double> s =
        AlternatedMedians(10, {[&] { at64.Batched(); }, [&] { at64.OneCallEach(); }});
    at64.Print(json, s[0], s[1]);
  }
  // The shape, cached length 1024, over an fp32 cache, a bf16 one
  // (kv_cache_dtype BF16: half the bytes) and an int8 one (INT8: a quarter,
  // plus a scale per token and head), all nine calls below taken in
  // alternation.
  auto engine_with = [&](void (*set)(AttentionDims&)) {
    AttentionDims dims = engine.dims();
    set(dims);
    absl::StatusOr<std::unique_ptr<MhaEngine>> made =
        MhaEngine::Create(dims, testing::RandomWeights(dims, 1));
    Check(made.status());
    return *std::move(made);
  };
  const std::unique_ptr<MhaEngine> bf16_cache =
      engine_with([](AttentionDims& d) { d.kv_cache_bf16 = true; });
  const std::unique_ptr<MhaEngine> int8_cache =
      engine_with([](AttentionDims& d) { d.kv_cache_int8 = true; });
  // The same batched steps over caches of 1 token: what a step costs apart
  // from reading the cache (projections, the new rows' writes), which the
  // cache's dtype does not shrink. Without it, the speedups below are
  // those of the cache reads alone.
  BatchedSteps fp32(engine, pool, 1024, *ws), bf16(*bf16_cache, pool, 1024, *ws),
      int8(*int8_cache, pool, 1024, *ws), fp32_fixed(engine, pool, 1, *ws),
      bf16_fixed(*bf16_cache, pool, 1, *ws), int8_fixed(*int8_cache, pool, 1, *ws);
  const std::vector<double> s = AlternatedMedians(
      15, {[&] { fp32.Batched(); }, [&] { fp32.OneCallEach(); }, [&] { bf16.Batched(); },
           [&] { bf16.OneCallEach(); }, [&] { int8.Batched(); }, [&] { int8.OneCallEach(); },
           [&] { fp32_fixed.Batched(); }, [&] { bf16_fixed.Batched(); },
           [&] { int8_fixed.Batched(); }});
  fp32.Print(json, s[0], s[1]);
  bf16.Print(json, s[2], s[3]);
  int8.Print(json, s[4], s[5]);
  Print(json, "decode_64x1_at1_batched", s[6] * 1e3, "ratio", 1.0, 1);
  Print(json, "decode_64x1_at1_bf16cache_batched", s[7] * 1e3, "fp32_cache_over_bf16", s[6] / s[7],
        1);
  Print(json, "decode_64x1_at1_int8cache_batched", s[8] * 1e3, "fp32_cache_over_int8", s[6] / s[8],
        1);
  Print(json, "decode_64x1_at1024_bf16cache_speedup", s[2] * 1e3, "fp32_cache_over_bf16",
        s[0] / s[2], 1.7);
  Print(json, "decode_64x1_at1024_int8cache_speedup", s[4] * 1e3, "fp32_cache_over_int8",
        s[0] / s[4], 2.5);
  // The reads alone (a row minus its 1-token row), against what the bytes
  // allow (0 when noise leaves no time for the reads).
  auto reads_over = [&](double fp32_s, double fp32_fixed_s, double s, double fixed_s) {
    return s > fixed_s ? (fp32_s - fp32_fixed_s) / (s - fixed_s) : 0.0;
  };
  const double fp32_block = static_cast<double>(engine.kv_layout().block_bytes());
  Print(json, "decode_64x1_at1024_bf16cache_reads_speedup", (s[2] - s[7]) * 1e3,
        "fp32_reads_over_bf16", reads_over(s[0], s[6], s[2], s[7]),
        fp32_block / static_cast<double>(bf16_cache->kv_layout().block_bytes()));
  Print(json, "decode_64x1_at1024_int8cache_reads_speedup", (s[4] - s[8]) * 1e3,
        "fp32_reads_over_int8", reads_over(s[0], s[6], s[4], s[8]),
        fp32_block / static_cast<double>(int8_cache->kv_layout().block_bytes()));
  // Steps riding along in an Attend call, against a call of their own:
  // a large batch and a small one.
  BenchMixedCall(engine, pool, 8, 128, json, *ws);
  BenchMixedCall(engine, pool, 4, 16, json, *ws);
}

}  // namespace mha
