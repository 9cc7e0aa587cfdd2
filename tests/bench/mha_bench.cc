// mha_bench: median time and GFLOP/s of the engine on the standard shapes
// (fp32, bf16 and int8 projections), each beside the rate of a plain oneDNN
// matmul of its type (n = 1024) measured right before it, round after round,
// the types of a shape alternated: the machine's ceiling at that moment
// (these machines are shared and noisy). One JSON object per line with
// --json.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/mha_engine.h"
#include "engine/ops/linear_layer.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/threads.h"
#include "tests/bench/decode_bench.h"
#include "tests/engine/alloc_counter.h"
#include "tests/engine/test_models.h"

ABSL_FLAG(int, min_reps, 10, "minimum timed repetitions per measurement");
ABSL_FLAG(double, min_seconds, 0.3, "minimum timed seconds per measurement");
ABSL_FLAG(int, rounds, 3, "measurements per shape, each right after one of the matmul ceiling");
ABSL_FLAG(std::string, dtypes, "f32,bf16",
          "compute types to run: f32, bf16, int8 (int8 projections, the core in bf16 where "
          "native)");
ABSL_FLAG(std::string, shapes, "", "only shapes whose name contains this");
ABSL_FLAG(bool, json, false, "one JSON object per line");
ABSL_FLAG(std::string, seq_lengths, "",
          "instead of the standard shapes: self-attention B=1 E=512 h=8 at these lengths, "
          "e.g. 128,1024,16384");
ABSL_FLAG(int64_t, max_score_bytes, mha::EngineOptions{}.max_score_bytes,
          "EngineOptions::max_score_bytes");
ABSL_FLAG(int64_t, runtime_dims_max_scores, mha::EngineOptions{}.runtime_dims_max_scores,
          "EngineOptions::runtime_dims_max_scores (0: a primitive per shape always)");
ABSL_FLAG(int64_t, tiled_min_keys, mha::EngineOptions{}.tiled_min_keys,
          "EngineOptions::tiled_min_keys (0: never key-tiled)");
ABSL_FLAG(int64_t, tiled_min_rows, mha::EngineOptions{}.tiled_min_rows,
          "EngineOptions::tiled_min_rows");
ABSL_FLAG(bool, choose_small_call_threads, mha::EngineOptions{}.choose_small_call_threads,
          "EngineOptions::choose_small_call_threads (small calls on one thread when faster; "
          "sets the call thread counts to all and 1, as the server's)");
ABSL_FLAG(bool, one_pass, mha::EngineOptions{}.one_pass,
          "EngineOptions::one_pass (bf16 blocks in one pass with AVX512-BF16, no AMX)");
ABSL_FLAG(int64_t, one_pass_min_rows, mha::EngineOptions{}.one_pass_min_rows,
          "EngineOptions::one_pass_min_rows (bf16 with AVX512-BF16; 0: only where "
          "tiled_min_keys and tiled_min_rows say)");
ABSL_FLAG(int64_t, tile_rows, mha::EngineOptions{}.tile_rows, "EngineOptions::tile_rows");
ABSL_FLAG(int64_t, tile_keys, mha::EngineOptions{}.tile_keys, "EngineOptions::tile_keys");
ABSL_FLAG(bool, wide, false,
          "instead of the standard shapes: wider models (E = 1024-2048, h = 16-32)");
ABSL_FLAG(int64_t, ragged_batch, 32,
          "requests in the ragged shape (what the server's batcher merged)");
ABSL_FLAG(bool, decode, false,
          "sessions: one Append of 1 token at cached length 4096 against a causal pass over "
          "4097 tokens, and 64 sessions' steps in one call against one call each (f32)");
ABSL_FLAG(bool, stop_check, false,
          "give the workspace a stop check that never stops, as the server does for a long "
          "call of Attend requests (what asking it costs)");
ABSL_FLAG(bool, overhead, false,
          "instead of the shapes: per-call time of small requests (B=1, E=256, h=4, self "
          "and cross, L in 17..128), first call of each length (cold) and again (warm)");

namespace mha {

using onednn::dt;
namespace {

struct Shape {
  std::string name;
  int64_t batch, q_len, kv_len, embed_dim, heads;  // kv_len 0: self-attention
  bool ragged = false;  // lengths uniform in [16, q_len] instead of all q_len
};

// The standard shapes, then (wide) the wider models on which the standard
// shapes' targets should hold as E and h grow.
std::vector<Shape> Shapes(bool wide) {
  struct Row {
    bool wide;
    Shape shape;
  };
  static const Row rows[] = {
      {false, {"self_b8_l128_e512_h8", 8, 128, 0, 512, 8}},
      {false, {"self_b1_l1024_e512_h8", 1, 1024, 0, 512, 8}},
      {false, {"cross_b8_l64_s256_e512_h8", 8, 64, 256, 512, 8}},
      {false, {"self_b1_l16_e256_h4", 1, 16, 0, 256, 4}},
      {false, {"self_b4_l512_e1024_h16", 4, 512, 0, 1024, 16}},
      // What the server's batcher builds from 32 small requests.
      {false, {"ragged_b32_l16-128_e256_h4", 32, 128, 0, 256, 4, true}},
      {true, {"self_b8_l128_e1024_h16", 8, 128, 0, 1024, 16}},
      {true, {"self_b8_l128_e1024_h32", 8, 128, 0, 1024, 32}},
      {true, {"self_b4_l512_e2048_h16", 4, 512, 0, 2048, 16}},
      {true, {"self_b4_l512_e2048_h32", 4, 512, 0, 2048, 32}},
      {true, {"cross_b8_l64_s256_e2048_h32", 8, 64, 256, 2048, 32}},
  };
  std::vector<Shape> shapes;
  for (const Row& row : rows) {
    if (row.wide == wide) shapes.push_back(row.shape);
  }
  return shapes;
}

// Sequence lengths of a shape: all q_len, or uniform in [16, q_len].
std::vector<int64_t> Lengths(const Shape& s) {
  std::vector<int64_t> lengths(s.batch, s.q_len);
  if (s.ragged) {
    std::mt19937 gen(5);
    std::uniform_int_distribution<int64_t> len(16, s.q_len);
    for (int64_t& l : lengths) l = len(gen);
  }
  return lengths;
}

double Flops(const Shape& s) {
  if (s.ragged) {
    double flops = 0;
    for (int64_t l : Lengths(s))
      flops += 8.0 * l * s.embed_dim * s.embed_dim + 4.0 * l * l * s.embed_dim;
    return flops;
  }
  const double t = s.batch * s.q_len, e = s.embed_dim;
  const double kv_len = s.kv_len == 0 ? s.q_len : s.kv_len, tk = s.batch * kv_len;
  const double projections = 2 * t * e * e + 2 * tk * e * 2 * e + 2 * t * e * e;
  const double attention = 2.0 * s.batch * s.q_len * kv_len * e * 2;
  return projections + attention;
}

// Median seconds of `fn` after a warm-up, over at least min_reps calls and
// min_seconds.
template <typename Fn>
double MedianSeconds(Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (static_cast<int>(times.size()) < absl::GetFlag(FLAGS_min_reps) ||
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
             absl::GetFlag(FLAGS_min_seconds)) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// What an empty OpenMP parallel region of all threads costs now, in us:
// the threads' wake-up and join, a cross-core round trip. On one 2-core
// VM it was 0.45 us in some processes and 1.25 in others (which physical
// cores the vCPUs and the team's memory landed on), and a 1 x 16 call
// took 24 against 32 us with it. The median of 5 batches.
double ForkJoinMicros() {
  std::vector<double> batches;
  for (int b = 0; b < 5; ++b) {
    constexpr int kRegions = 2000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kRegions; ++i) {
#pragma omp parallel
      {
        if (omp_get_thread_num() < 0) std::abort();  // never: an empty region the compiler keeps
      }
    }
    batches.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        kRegions);
  }
  return Median(batches);
}

// `ceiling` is the matmul rate measured next to this shape, in GFLOP/s;
// `fork_join` ForkJoinMicros then; `scratch` the bytes the workspace held
// after the runs.
void Report(const std::string& what, const std::string& dtype, double seconds, double flops,
            double ceiling, double fork_join, size_t scratch) {
  const double rate = flops / seconds * 1e-9;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"name\": \"%s\", \"dtype\": \"%s\", \"ms\": %.5f, \"gflops\": %.2f, "
        "\"matmul_gflops\": %.2f, \"fork_join_us\": %.2f, \"scratch_mb\": %.1f}\n",
        what.c_str(), dtype.c_str(), seconds * 1e3, rate, ceiling, fork_join, scratch / 1048576.0);
  } else {
    std::printf(
        "%-28s %-5s %10.4f ms %7.1f GFLOP/s  %4.0f %% of matmul (%.0f), fork/join %.2f us\n",
        what.c_str(), dtype.c_str(), seconds * 1e3, rate, 100 * rate / ceiling, ceiling, fork_join);
  }
  std::fflush(stdout);
}

// The compute types the bench runs: "f32", "bf16" and "int8" (int8
// projections, the core in bf16 where native).
struct BenchType {
  std::string name;
  bool bf16 = false, int8 = false;
};

AttentionDims DimsFor(int64_t e, int64_t heads, const BenchType& type) {
  AttentionDims d = testing::MakeDims(e, heads);
  d.bf16 = type.bf16 || type.int8;  // as ResolveDims sets an INT8 model's
  d.int8 = type.int8;
  return d;
}

// A plain oneDNN matmul n x n x n with weights reordered once: the rate
// this machine reaches on an easy, large product of the type right now
// (int8: u8 x s8 -> s32, the product an int8 projection runs).
class MatmulCeiling {
 public:
  explicit MatmulCeiling(const BenchType& type) : engine_(dnnl::engine::kind::cpu, 0) {
    using tag = dnnl::memory::format_tag;
    const dt src = type.int8 ? dt::u8 : type.bf16 ? dt::bf16 : dt::f32;
    const dt wei = type.int8 ? dt::s8 : src;
    const dt dst = type.int8 ? dt::s32 : dt::f32;
    const dnnl::memory::desc src_md({kN, kN}, src, tag::ab), dst_md({kN, kN}, dst, tag::ab);
    const dnnl::memory::desc any({kN, kN}, wei, tag::any);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, any, dst_md), engine_);
    matmul_ = dnnl::matmul(pd);
    src_ = dnnl::memory(src_md, engine_);
    weights_ = dnnl::memory(pd.weights_desc(), engine_);
    dst_ = dnnl::memory(dst_md, engine_);
    std::memset(src_.get_data_handle(), 1, src_md.get_size());
    std::memset(weights_.get_data_handle(), 1, pd.weights_desc().get_size());
  }

  double MeasureGflops() {
    dnnl::stream stream(engine_);
    return 2.0 * kN * kN * kN / MedianSeconds([&] {
             matmul_.execute(
                 stream,
                 {{DNNL_ARG_SRC, src_}, {DNNL_ARG_WEIGHTS, weights_}, {DNNL_ARG_DST, dst_}});
             stream.wait();
           }) *
           1e-9;
  }

 private:
  static constexpr int64_t kN = 1024;
  dnnl::engine engine_;
  dnnl::matmul matmul_;
  dnnl::memory src_, weights_, dst_;
};

EngineOptions OptionsFromFlags() {
  EngineOptions options;
  options.max_score_bytes = absl::GetFlag(FLAGS_max_score_bytes);
  options.tiled_min_keys = absl::GetFlag(FLAGS_tiled_min_keys);
  options.tiled_min_rows = absl::GetFlag(FLAGS_tiled_min_rows);
  options.one_pass = absl::GetFlag(FLAGS_one_pass);
  options.choose_small_call_threads = absl::GetFlag(FLAGS_choose_small_call_threads);
  options.one_pass_min_rows = absl::GetFlag(FLAGS_one_pass_min_rows);
  options.tile_rows = absl::GetFlag(FLAGS_tile_rows);
  options.tile_keys = absl::GetFlag(FLAGS_tile_keys);
  options.runtime_dims_max_scores = absl::GetFlag(FLAGS_runtime_dims_max_scores);
  return options;
}

// Small requests one at a time, as a server without batching runs them: the
// mean per-call time of each length's first call (creating any primitive
// it needs) and of a second pass (everything cached). Self-attention, then
// cross-attention with key lengths walking another way.
void BenchOverhead(const BenchType& type) {
  const AttentionDims d = DimsFor(256, 4, type);
  auto engine = MhaEngine::Create(d, testing::RandomWeights(d, 1), OptionsFromFlags());
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return;
  }
  std::unique_ptr<Workspace> ws = (*engine)->NewWorkspace();
  const std::vector<float> data = testing::RandomVector(128 * 256, 2);
  std::vector<float> output(128 * 256);
  for (const bool cross : {false, true}) {
    double pass_us[2] = {0, 0};
    testing::AllocationCounts warm;  // summed over the warm pass
    int calls = 0;
    for (int pass = 0; pass < 2; ++pass) {
      calls = 0;
      for (int64_t len = 17; len <= 128; ++len, ++calls) {
        const int64_t kv = cross ? 145 - len : len;
        AttentionBatch batch;
        batch.query = absl::MakeConstSpan(data.data(), len * 256);
        if (cross) {
          batch.kind = AttentionKind::kCrossValueIsKey;
          batch.key = absl::MakeConstSpan(data.data(), kv * 256);
        }
        SetUniformOffsets(1, len, kv, 4, batch);
        const testing::AllocationCounts before = testing::CurrentAllocationCounts();
        const auto start = std::chrono::steady_clock::now();
        const absl::Status status =
            (*engine)->Run(batch, {absl::MakeSpan(output.data(), len * 256), {}, false}, *ws);
        pass_us[pass] +=
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                .count();
        if (pass == 1) warm = warm + (testing::CurrentAllocationCounts() - before);
        if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
      }
    }
    const double ours = static_cast<double>(warm.outside_onednn_execute()) / calls;
    const double onednn = static_cast<double>(warm.in_onednn_execute) / calls;
    const double executes = static_cast<double>(warm.executes) / calls;
    const char* what = cross ? "overhead_cross" : "overhead_self";
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"name\": \"%s\", \"dtype\": \"%s\", \"cold_us\": %.1f, \"warm_us\": %.1f, "
          "\"warm_allocations_ours\": %.1f, \"warm_allocations_onednn\": %.1f, "
          "\"warm_executes\": %.1f}\n",
          what, type.name.c_str(), pass_us[0] / calls, pass_us[1] / calls, ours, onednn, executes);
    } else {
      std::printf(
          "%-28s %-5s first call %8.1f us, warm %8.1f us; per warm call: %.1f allocations "
          "of ours, %.1f inside %.1f oneDNN executes (mean of %d lengths)\n",
          what, type.name.c_str(), pass_us[0] / calls, pass_us[1] / calls, ours, onednn, executes,
          calls);
    }
  }
}

// One compute type's engine and request of a shape, ready to time.
class ShapeRun {
 public:
  ShapeRun(const Shape& s, const BenchType& type) : shape_(s), type_(type) {
    const AttentionDims d = DimsFor(s.embed_dim, s.heads, type);
    auto engine = MhaEngine::Create(d, testing::RandomWeights(d, 1), OptionsFromFlags());
    if (!engine.ok()) {
      std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
      return;
    }
    engine_ = *std::move(engine);
    const int64_t kv_len = s.kv_len == 0 ? s.q_len : s.kv_len;
    const std::vector<int64_t> lengths = Lengths(s);
    int64_t tokens = 0;
    for (int64_t l : lengths) tokens += l;
    query_ = testing::RandomVector(tokens * s.embed_dim, 2);
    memory_ = testing::RandomVector(s.kv_len == 0 ? 0 : s.batch * kv_len * s.embed_dim, 3);
    batch_.kind = memory_.empty() ? AttentionKind::kSelf : AttentionKind::kCrossValueIsKey;
    batch_.query = query_;
    batch_.key = memory_;  // value = key: the usual encoder memory
    SetUniformOffsets(s.batch, s.q_len, kv_len, s.heads, batch_);
    if (s.ragged) {  // self-attention over sequences of different lengths
      for (size_t i = 0; i < lengths.size(); ++i) {
        batch_.q_offsets[i + 1] = batch_.q_offsets[i] + lengths[i];
      }
    }
    output_.resize(query_.size());
    ws_ = engine_->NewWorkspace();
    if (absl::GetFlag(FLAGS_stop_check)) ws_->set_stop_check([] { return false; });
  }

  bool ok() const { return engine_ != nullptr; }
  // One round: the type's matmul ceiling, then the shape.
  void Measure(MatmulCeiling& ceiling) {
    ceilings_.push_back(ceiling.MeasureGflops());
    fork_joins_.push_back(ForkJoinMicros());
    const AttentionOutputs out{absl::MakeSpan(output_), {}, false};
    seconds_.push_back(MedianSeconds([&] {
      const absl::Status status = engine_->Run(batch_, out, *ws_);
      if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
    }));
  }
  void Report() const {
    mha::Report(shape_.name, type_.name, Median(seconds_), Flops(shape_), Median(ceilings_),
                Median(fork_joins_), ws_->bytes_held());
  }

 private:
  Shape shape_;
  BenchType type_;
  std::unique_ptr<MhaEngine> engine_;
  std::vector<float> query_, memory_, output_;
  AttentionBatch batch_;
  std::unique_ptr<Workspace> ws_;
  std::vector<double> seconds_, ceilings_, fork_joins_;
};

// A shape in every compute type, the types alternated round by round (so
// that their ratios are taken minutes apart at most, not a whole run).
void BenchShape(const Shape& s, const std::vector<BenchType>& types,
                std::vector<std::unique_ptr<MatmulCeiling>>& ceilings) {
  std::vector<std::unique_ptr<ShapeRun>> runs;
  for (const BenchType& type : types) runs.push_back(std::make_unique<ShapeRun>(s, type));
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (size_t i = 0; i < runs.size(); ++i) {
      if (runs[i]->ok()) runs[i]->Measure(*ceilings[i]);
    }
  }
  for (const auto& run : runs) {
    if (run->ok()) run->Report();
  }
}

}  // namespace
}  // namespace mha

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // As the server's worker pool sets them (all cores for a call alone, one
  // beside another): small calls may then run on one thread.
  if (absl::GetFlag(FLAGS_choose_small_call_threads) && mha::ComputeThreads() > 1) {
    mha::SetCallThreadCounts({mha::ComputeThreads(), 1});
  }
  if (absl::GetFlag(FLAGS_decode)) {
    mha::BenchDecode(absl::GetFlag(FLAGS_json));
    return 0;
  }
  const std::string filter = absl::GetFlag(FLAGS_shapes);
  std::vector<mha::Shape> shapes = mha::Shapes(absl::GetFlag(FLAGS_wide));
  if (!absl::GetFlag(FLAGS_seq_lengths).empty()) {
    shapes.clear();
    for (absl::string_view l : absl::StrSplit(absl::GetFlag(FLAGS_seq_lengths), ',')) {
      int64_t len = 0;
      if (!absl::SimpleAtoi(l, &len) || len <= 0) {
        std::fprintf(stderr, "--seq_lengths: bad length '%s'\n", std::string(l).c_str());
        return 2;
      }
      shapes.push_back({absl::StrFormat("seq_l%d_e512_h8", len), 1, len, 0, 512, 8});
    }
  }
  std::vector<mha::BenchType> types;
  for (absl::string_view dtype : absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',')) {
    const mha::BenchType type{std::string(dtype), dtype == "bf16", dtype == "int8"};
    if (dtype != "f32" && !type.bf16 && !type.int8) {
      std::fprintf(stderr, "--dtypes: '%s' is not one of f32, bf16, int8\n", type.name.c_str());
      return 2;
    }
    if (type.bf16 && !mha::CpuCanComputeBf16()) {
      std::fprintf(stderr,
                   "mha_bench: no bf16 on this CPU (oneDNN's bf16 kernels need "
                   "AVX-512): bf16 skipped\n");
      continue;
    }
    if (type.int8 && !mha::CpuHasInt8Dot()) {
      std::fprintf(stderr,
                   "mha_bench: no int8 dot products on this CPU (VNNI or AMX-INT8): int8 "
                   "skipped\n");
      continue;
    }
    types.push_back(type);
  }
  if (absl::GetFlag(FLAGS_overhead)) {
    for (const mha::BenchType& type : types) mha::BenchOverhead(type);
    return 0;
  }
  std::vector<std::unique_ptr<mha::MatmulCeiling>> ceilings;
  for (const mha::BenchType& type : types) {
    ceilings.push_back(std::make_unique<mha::MatmulCeiling>(type));
  }
  for (const mha::Shape& s : shapes) {
    if (s.name.find(filter) == std::string::npos) continue;
    mha::Shape shape = s;
    if (shape.ragged) shape.batch = absl::GetFlag(FLAGS_ragged_batch);
    mha::BenchShape(shape, types, ceilings);
  }
  return 0;
}
