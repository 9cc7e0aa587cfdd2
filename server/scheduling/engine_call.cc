// EngineCallRunner: one engine call from a worker's tasks to their answers.
#include "server/scheduling/engine_call.h"

#include <algorithm>
#include <new>
#include <optional>
#include <utility>

#include "engine/large_buffer.h"
#include "engine/output_check.h"
#include "server/scheduling/admission.h"

namespace mha::server {
namespace {

// From this size an FP16 or BF16 output is converted by the worker (and
// sent as is); smaller ones are converted where the front end writes them.
constexpr size_t kConvertedMinBytes = size_t{256} << 10;

// Whether `result`'s output is finite: finite inputs can still overflow
// f32. For a call that sends it converted, a large FP16 or BF16 output is
// converted in the same pass, into a kept buffer (checked and converted
// apart, 16 MiB of f32 were read twice: ~0.5 ms more a call). On the
// worker's compute threads, which are idle until its next call.
bool CheckOutput(const AttendCall& call, AttentionResult& result) {
  const DType dtype = call.input().output_dtype();
  const size_t bytes = result.output.size() * DTypeSize(dtype);
  if (dtype == DType::kF32 || bytes < kConvertedMinBytes || !call.SendsConvertedOutput()) {
    return AllFiniteAcrossThreads(result.output);
  }
  size_t capacity = 0;
  void* data = nullptr;
  try {
    data = TakeLarge(bytes, &capacity);
  } catch (const std::bad_alloc&) {  // the front end's own conversion says so
    return AllFiniteAcrossThreads(result.output);
  }
  std::shared_ptr<const void> owner(data, ReturnLargeDeleter{capacity});
  if (!ConvertFiniteAcrossThreads(result.output, dtype, static_cast<uint8_t*>(data))) return false;
  result.converted = {dtype, {static_cast<const uint8_t*>(data), bytes}, std::move(owner)};
  return true;
}

}  // namespace

EngineCallRunner::EngineCallRunner(const MhaEngine& engine, ModelMetrics& metrics,
                                   const Clock& clock, ModelStatistics* statistics)
    : engine_(engine),
      metrics_(metrics),
      clock_(clock),
      statistics_(statistics),
      reported_misses_(engine.PrimitiveCacheMisses()) {}  // warm-up misses are not counted

std::vector<std::unique_ptr<AttendCall>> EngineCallRunner::DropUnwanted(
    std::vector<std::unique_ptr<AttendCall>> batch) const {
  const absl::Time now = clock_.Now();
  std::vector<std::unique_ptr<AttendCall>> live;
  live.reserve(batch.size());
  for (std::unique_ptr<AttendCall>& r : batch) {
    r->waited = now - r->enqueued;
    metrics_.queue_duration->Observe(absl::ToDoubleSeconds(r->waited));
    if (!r->refusal.ok()) {
      r->CountDropped(metrics_, "memory");
      r->Fail(r->refusal);
    } else if (absl::Status unwanted = Unwanted(*r, now, metrics_); !unwanted.ok()) {
      r->Fail(unwanted);
    } else {
      live.push_back(std::move(r));
    }
  }
  return live;
}

void EngineCallRunner::RunProjections(std::vector<std::unique_ptr<ProjectionTask>> projections,
                                      Workspace& ws) const {
  const absl::Time now = clock_.Now();
  for (auto& p : projections) {
    if (absl::Status unwanted = Unwanted(*p, now, metrics_); !unwanted.ok()) {
      p->Fail(unwanted);
    } else {
      p->Run(ws);
    }
    p.reset();           // its memory comes back before the next one runs
    ws.BetweenBlocks();  // waiting steps may go between projections
  }
}

void EngineCallRunner::Run(const std::vector<std::unique_ptr<AttendCall>>& live,
                           std::vector<StartedStep>& steps, Workspace& ws) {
  // The steps (and chunks) go first, in an engine call of their own, and
  // are answered before the requests are computed: a step waits for its
  // own rows, not for a capped call's Attend rows as well and the
  // preemptions of the worker in between (docs/PERFORMANCE.md).
  size_t steps_answered = 0, requests_answered = 0;
  try {
    if (!steps.empty()) Compute({}, steps, ws, steps_answered);
    std::vector<StartedStep> no_steps;
    if (!live.empty()) Compute(live, no_steps, ws, requests_answered);
  } catch (const std::bad_alloc&) {  // the call fails, the server goes on
    const absl::Status status = absl::ResourceExhaustedError(
        "out of memory while computing this request's batch; retry later");
    for (size_t i = steps_answered; i < steps.size(); ++i) steps[i].task->Finish(status, {}, {});
    for (size_t i = requests_answered; i < live.size(); ++i) live[i]->Fail(status);
  }
}

bool EngineCallRunner::NobodyWaits(const std::vector<std::unique_ptr<AttendCall>>& live,
                                   size_t& first_wanted) const {
  const absl::Time now = clock_.Now();
  while (first_wanted < live.size() &&
         (live[first_wanted]->Cancelled() || now > live[first_wanted]->deadline)) {
    ++first_wanted;
  }
  return first_wanted == live.size();
}

void EngineCallRunner::ReportPrimitiveCacheMisses() {
  const uint64_t now = engine_.PrimitiveCacheMisses();
  uint64_t reported = reported_misses_.load();
  while (now > reported && !reported_misses_.compare_exchange_weak(reported, now)) {
  }
  if (now > reported)
    metrics_.primitive_cache_misses->Increment(static_cast<double>(now - reported));
}

namespace {

// One engine call's outputs: the requests' and steps' output rows, the
// requests' weights and the steps' weights. Held by the call and by the
// answers that send bytes from it, so it lives until the last of them is
// sent. The memory budget still counts each request's f32 results and a
// response of its size (CostOf) until its own answer is sent: an answer
// sent from here holds fewer bytes than its reservation, and a request's
// rows outlive its reservation only while another answer of its call is
// being sent.
struct CallOutputs {
  CallOutputs(int64_t output_elements, int64_t weights_elements, int64_t step_weights_elements)
      : output(static_cast<size_t>(output_elements)),
        weights(static_cast<size_t>(weights_elements)),
        step_weights(static_cast<size_t>(step_weights_elements)) {}
  LargeArray<float> output, weights, step_weights;
};

// A call's attention work (scores and weighted sums) from which it may be
// stopped: about one yield wave of the engine (EngineOptions).
constexpr double kStopCheckFlops = 256 << 20;

double AttentionFlops(const std::vector<std::unique_ptr<AttendCall>>& live, int64_t embed_dim) {
  double flops = 0;
  for (const auto& r : live) {
    const AttentionRequest& in = r->input();
    const int64_t keys = in.kv_len() > 0 ? in.kv_len() : in.q_len();
    flops += 4.0 * in.rows() * in.q_len() * keys * embed_dim;
  }
  return flops;
}

}  // namespace

void EngineCallRunner::Compute(const std::vector<std::unique_ptr<AttendCall>>& live,
                               std::vector<StartedStep>& steps, Workspace& ws, size_t& answered) {
  const absl::Time merging = absl::Now();
  std::vector<const AttentionRequest*> inputs;
  int64_t tokens = 0;
  for (const auto& r : live) {
    inputs.push_back(&r->input());
    tokens += r->input().tokens();
  }
  // The steps' query rows in one buffer (Run passes steps or requests,
  // never both: the engine's joint call over both kinds is not used here).
  std::vector<float> step_query;
  StepBatch step_batch;
  bool step_weights_wanted = false;
  for (const StartedStep& s : steps) {
    step_query.insert(step_query.end(), s.plan.query.begin(), s.plan.query.end());
    step_batch.steps.push_back(s.plan.step);
    step_weights_wanted |= s.plan.need_weights;
  }
  step_batch.query = step_query;
  std::optional<RaggedBatch> merged;
  if (!live.empty()) merged.emplace(inputs);
  static const AttentionBatch kNoSequences;
  const int64_t request_elements = merged ? merged->output_elements() : 0;
  const int64_t step_elements = static_cast<int64_t>(step_batch.query.size());
  const int64_t step_weights_elements =
      step_weights_wanted ? engine_.StepWeightsElements(step_batch) : 0;
  // Every element is written by the engine: no zero-fill; huge pages for
  // large outputs (a fresh 4 KiB page costs microseconds to fault in).
  // Shared with the requests' answers, which may send f32 bytes from here.
  const auto buffers =
      std::make_shared<CallOutputs>(request_elements + step_elements,
                                    merged ? merged->weights_elements() : 0, step_weights_elements);
  LargeArray<float>& output = buffers->output;
  LargeArray<float>& step_weights = buffers->step_weights;
  const absl::Span<float> all_output(output.data(), request_elements);
  const absl::Span<float> all_weights(buffers->weights.data(), buffers->weights.size());
  const MixedOutputs out{absl::MakeSpan(output.data(), output.size()), all_weights,
                         merged && merged->per_head_weights(),
                         absl::MakeSpan(step_weights.data(), step_weights.size())};
  // A long call of Attend requests that nobody waits for any more stops at
  // its next yield point (steps always finish: their sessions' caches
  // change). A short one ends within about a yield interval anyway.
  size_t first_wanted = 0;
  bool stopped = false;
  if (steps.empty() && AttentionFlops(live, engine_.dims().embed_dim) >= kStopCheckFlops) {
    ws.set_stop_check([&] { return stopped = NobodyWaits(live, first_wanted); });
  }
  const absl::Time start = absl::Now();
  const absl::Status status =
      engine_.Compute(merged ? merged->batch() : kNoSequences, step_batch, out, ws);
  const absl::Time computed = absl::Now();
  ws.set_stop_check(nullptr);
  metrics_.compute_duration->Observe(absl::ToDoubleSeconds(computed - start));
  ReportPrimitiveCacheMisses();
  // The requests' answers are encoded, then the call's statistics recorded
  // in one step, before any answer leaves.
  std::vector<absl::Status> answers(live.size(), status);
  if (stopped && !status.ok()) {  // each says why, counted as dropped
    const absl::Time now = clock_.Now();
    for (size_t i = 0; i < live.size(); ++i) {
      const absl::Status why = Unwanted(*live[i], now, metrics_, "computed");
      if (!why.ok()) answers[i] = why;
    }
  }
  if (status.ok()) {
    for (size_t i = 0; i < live.size(); ++i) {
      live[i]->compute_time = computed - start;
      AttentionResult result{
          merged->OutputOf(i, all_output), merged->WeightsOf(i, all_weights), buffers, {}};
      answers[i] = CheckOutput(*live[i], result)
                       ? live[i]->Prepare(result)
                       : absl::InvalidArgumentError(
                             "inputs too large: the attention overflows float32 (non-finite "
                             "result)");
    }
    RecordCall(live, answers, steps, merging, start, computed);
  }
  // The steps first. If an answer throws (out of memory), Run fails
  // the rest.
  const int64_t e = engine_.dims().embed_dim;
  int64_t row = 0, w_off = 0;
  for (; answered < steps.size(); ++answered) {
    const StartedStep& s = steps[answered];
    const int64_t t = s.plan.step.tokens;
    const int64_t w = step_weights_wanted ? t * s.plan.keys : 0;
    const absl::Span<const float> step_out = out.output.subspan(request_elements + row * e, t * e);
    const absl::Span<const float> step_w =
        s.plan.need_weights ? absl::Span<const float>(out.step_weights).subspan(w_off, w)
                            : absl::Span<const float>();
    row += t;
    w_off += w;
    s.task->Finish(status, step_out, step_w);
  }
  if (live.empty()) return;
  metrics_.batch_requests->Observe(static_cast<double>(live.size()));
  metrics_.batch_tokens->Observe(static_cast<double>(tokens));
  metrics_.tokens->Increment(static_cast<double>(tokens));
  for (; answered < steps.size() + live.size(); ++answered) {
    const size_t i = answered - steps.size();
    live[i]->Answer(answers[i]);
  }
}

void EngineCallRunner::RecordCall(const std::vector<std::unique_ptr<AttendCall>>& live,
                                  const std::vector<absl::Status>& answers,
                                  const std::vector<StartedStep>& steps, absl::Time merging,
                                  absl::Time start, absl::Time computed) const {
  if (statistics_ == nullptr) return;
  ModelStatistics::Call call;
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < live.size(); ++i) {
    AttendCall& r = *live[i];
    if (r.statistics == nullptr) continue;
    ++call.batch_requests;
    call.batch_rows += static_cast<uint64_t>(r.input().rows());
    if (!answers[i].ok()) continue;
    call.AddAnswer(now - r.arrived, r.waited, r.input().rows());
    r.counted = true;
  }
  // A session step is a request of one sequence (a chunk of a long
  // request is not counted: its request is, when its last chunk is done).
  for (const StartedStep& s : steps) {
    if (s.task->statistics == nullptr) continue;
    ++call.batch_requests;
    ++call.batch_rows;
    call.AddAnswer(now - s.task->arrived, s.task->waited, 1);
    s.task->counted = true;
  }
  call.input = start - merging;
  call.infer = computed - start;
  call.output = now - computed;
  statistics_->Record(call);
}

}  // namespace mha::server
