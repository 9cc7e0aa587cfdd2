#include "server/scheduling/batcher.h"

#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "server/scheduling/admission.h"
#include "server/scheduling/split_attend.h"

namespace mha::server {

namespace {

std::unique_ptr<WorkerPool> OwnPool(const BatcherOptions& o) {
  if (o.pool != nullptr) return nullptr;
  return std::make_unique<WorkerPool>(WorkerPoolOptions{
      .workers = o.workers, .compute_threads = o.compute_threads, .clock = o.clock});
}

}  // namespace

Batcher::Batcher(std::string model, const MhaEngine& engine, BatcherOptions options,
                 ModelMetrics& metrics)
    : model_(std::move(model)),
      engine_(engine),
      options_(options),
      metrics_(metrics),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      own_pool_(OwnPool(options)),
      pool_(options.pool != nullptr ? *options.pool : *own_pool_),
      max_batch_tokens_(options.max_batch_tokens > 0
                            ? options.max_batch_tokens
                            : BatcherOptions::kTokensPerThread * pool_.MaxThreadsPerCall()),
      tokens_with_steps_(options.max_batch_tokens_with_steps > 0
                             ? std::min(options.max_batch_tokens_with_steps, max_batch_tokens_)
                             : max_batch_tokens_),
      reported_misses_(engine.PrimitiveCacheMisses()) {  // warm-up misses are not counted
  registration_ = pool_.Attach(this);
}

Batcher::~Batcher() {
  Stop();
  pool_.Detach(registration_);
}

void Batcher::Enqueue(std::unique_ptr<Task> task) {
  const bool step = task->kind() == Task::Kind::kStep;
  absl::Status admitted;
  try {
    admitted = Admit(task);
  } catch (const std::bad_alloc&) {  // the queue could not grow: nothing changed
    admitted = absl::ResourceExhaustedError("out of memory queueing the request; retry later");
  }
  if (!admitted.ok()) {
    const bool projection = task->kind() == Task::Kind::kProjection;
    task->Fail(admitted);  // outside the lock
    // Steps of the session it would have opened wait for it: they are
    // refused now.
    if (projection) WakeLeftSteps(/*ran_some=*/true, /*more=*/false);
    return;
  }
  pool_.Wake(registration_, step);
}

namespace {

const char* Noun(const Task& task) {
  switch (task.kind()) {
    case Task::Kind::kAttend:
      return "request";
    case Task::Kind::kStep:
      return "step";
    case Task::Kind::kProjection:
      return "session memory";
  }
  return "task";
}

}  // namespace

absl::Status Batcher::Admit(std::unique_ptr<Task>& task) {
  MutexLock lock(mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  const int64_t waiting = static_cast<int64_t>(queue_.size() + steps_.size() + projections_.size());
  if (waiting >= options_.max_queue_size) {
    task->CountDropped(metrics_, "queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", options_.max_queue_size, " requests waiting)"));
  }
  if (queued_bytes_ + task->wire_bytes > options_.max_queue_bytes) {
    task->CountDropped(metrics_, "queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", queued_bytes_, " bytes waiting, this ", Noun(*task),
        " ", task->wire_bytes, ", limit ", options_.max_queue_bytes, ")"));
  }
  MemoryBudget* memory = options_.memory;
  if (memory != nullptr && task->kind() == Task::Kind::kStep) {
    // Its working memory as of its session's position now (an Attend
    // request's front end checked its own).
    const RequestCost cost{.queued_bytes = task->queued_bytes, .active_bytes = task->active_bytes};
    if (absl::Status fits = CheckStepMemory(cost, memory->capacity()); !fits.ok()) {
      task->CountDropped(metrics_, "memory");
      return fits;
    }
  }
  if (memory != nullptr && task->kind() == Task::Kind::kProjection &&
      task->queued_bytes > memory->capacity()) {
    task->CountDropped(metrics_, "memory");
    return absl::ResourceExhaustedError(absl::StrCat(
        "the session's memory needs ", WithCommas(task->queued_bytes),
        " bytes of working memory to be projected; the server's memory budget for requests is ",
        WithCommas(memory->capacity()),
        " (--memory_limit_bytes less the engines' reserve and "
        "the session cache): send a shorter memory"));
  }
  if (memory != nullptr && !memory->TryReserveQueued(task->queued_bytes, *task->memory)) {
    task->CountDropped(metrics_, "memory");
    return absl::ResourceExhaustedError(absl::StrCat(
        "server memory budget full: requests in flight hold ", WithCommas(memory->reserved()),
        " of ", WithCommas(memory->capacity()), " bytes and this ", Noun(*task), " needs ",
        WithCommas(task->queued_bytes), " to wait in the queue; retry later"));
  }
  task->enqueued = clock_.Now();
  Queue(task);  // if it throws, nothing has changed
  PublishDepth();
  return absl::OkStatus();
}

void Batcher::Queue(std::unique_ptr<Task>& task) {
  // Each lane makes room first, so that a throw leaves `task` with the
  // caller, which answers it.
  const int64_t bytes = task->wire_bytes;
  switch (task->kind()) {
    case Task::Kind::kStep:
      steps_.emplace_back();
      steps_.back().reset(static_cast<StepTask*>(task.release()));
      steps_ready_ = true;
      break;
    case Task::Kind::kProjection:
      projections_.emplace_back();
      projections_.back().reset(static_cast<ProjectionTask*>(task.release()));
      break;
    case Task::Kind::kAttend: {
      // Behind every request of its level or a higher one (a lower number).
      const uint64_t levels = options_.priority_levels;
      const uint64_t asked = task->priority;
      const uint64_t level = levels == 0                      ? 0
                             : (asked == 0 || asked > levels) ? options_.default_priority_level
                                                              : asked;
      auto behind = queue_.end();
      while (behind != queue_.begin() && (*std::prev(behind))->priority > level) --behind;
      auto slot = queue_.emplace(behind);
      slot->reset(static_cast<AttendCall*>(task.release()));
      (*slot)->priority = level;
      queued_tokens_ += (*slot)->input().tokens();
      break;
    }
  }
  queued_bytes_ += bytes;
}

void Batcher::Stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  pool_.Wake(registration_);  // what is queued goes now
  MutexLock lock(mu_);
  while (!Drained()) drained_cv_.Wait(lock);
}

void Batcher::PublishDepth() {
  metrics_.queue_depth->Set(
      static_cast<double>(queue_.size() + steps_.size() + projections_.size()));
}

bool Batcher::Drained() const {
  return queue_.empty() && steps_.empty() && projections_.empty() && in_flight_ == 0;
}

absl::Status Batcher::Unwanted(Task& task, absl::Time now) const {
  if (task.Cancelled()) {
    task.CountDropped(metrics_, "cancelled");
    return absl::CancelledError("client cancelled the request");
  }
  if (now > task.deadline) {
    task.CountDropped(metrics_, "deadline");
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while the ", Noun(task), " was queued"));
  }
  return absl::OkStatus();
}

// A batch may close: it is full, its oldest request waited long enough, or
// batching is off, or the batcher is draining, or session steps go now.
// Requests that cannot join the oldest one's batch (another signature) do
// not fill it.
bool Batcher::BatchReady(bool steps) const {
  if (queue_.empty()) return false;
  if (steps || stopping_ || !options_.enabled) return true;
  if (clock_.Now() - queue_.front()->enqueued >= options_.max_queue_delay) return true;
  const int64_t limit = TokenLimit();
  return queued_tokens_ >= limit && TokensJoiningOldest(limit) >= limit;
}

int64_t Batcher::TokensJoiningOldest(int64_t limit) const {
  const BatchSignature& signature = queue_.front()->signature();
  int64_t tokens = 0;
  for (const auto& r : queue_) {
    if (r->signature() == signature) tokens += r->input().tokens();
    if (tokens >= limit) break;
  }
  return tokens;
}

bool Batcher::SplitsOldest() const {
  const AttentionRequest& oldest = queue_.front()->input();
  return options_.enabled && tokens_with_steps_ < max_batch_tokens_ && pool_.StepsRecently() &&
         oldest.q_len() > tokens_with_steps_ && Splittable(oldest, engine_);
}

void Batcher::QueueChunks(std::vector<std::unique_ptr<StepTask>> chunks) {
  {
    MutexLock lock(mu_);
    for (auto& chunk : chunks) {
      chunk->enqueued = clock_.Now();
      steps_.push_back(std::move(chunk));
    }
    steps_ready_ = true;
    PublishDepth();
  }
  pool_.Wake(registration_, /*steps=*/true);
}

int64_t Batcher::TokenLimit() const {
  return pool_.StepsRecently() ? tokens_with_steps_ : max_batch_tokens_;
}

MemoryBudget::Growth Batcher::ReserveActive(Task& task) {
  if (options_.memory == nullptr) return MemoryBudget::Growth::kGrown;
  return options_.memory->TryGrowActive(task.active_bytes, *task.memory);
}

std::unique_ptr<PoolWork> Batcher::Hand(std::unique_ptr<Work> work) {
  ++in_flight_;
  work->counted = true;
  return work;
}

Batcher::Work::~Work() {
  if (!counted) return;  // never handed out (Poll holds the lock then)
  {
    MutexLock lock(batcher.mu_);
    --batcher.in_flight_;
  }
  batcher.drained_cv_.NotifyAll();
}

void Batcher::Work::Run(Workspace& ws) {
  if (!projections.empty()) batcher.RunProjections(std::move(projections), ws);
  if (!batch.empty() || steps) batcher.Compute(std::move(batch), steps, ws);
}

std::unique_ptr<PoolWork> Batcher::Poll(Idle& idle) {
  MutexLock lock(mu_);
  // Made first: once requests leave the queue, nothing allocates.
  auto work = std::make_unique<Work>(*this);
  if (!projections_.empty()) {
    for (auto& p : projections_) {
      queued_bytes_ -= p->wire_bytes;
      // Their bytes come back by themselves once they ran.
      if (options_.memory != nullptr) options_.memory->MarkLeaving(*p->memory);
      work->projections.push_back(std::move(p));
    }
    projections_.clear();
    PublishDepth();
    return Hand(std::move(work));
  }
  if (steps_ready_) {
    steps_ready_ = false;
    work->steps = true;
  }
  if (!BatchReady(work->steps)) {
    if (work->steps) return Hand(std::move(work));  // steps alone
    if (!queue_.empty()) idle.retry_at = queue_.front()->enqueued + options_.max_queue_delay;
    return nullptr;
  }
  // The oldest request first gets the memory to compute and answer it.
  AttendCall& oldest = *queue_.front();
  const MemoryBudget::Growth growth = ReserveActive(oldest);
  if (growth == MemoryBudget::Growth::kGrown) {
    if (SplitsOldest()) {
      try {
        work->projections.push_back(SplitAttendCall(
            queue_.front(), engine_, tokens_with_steps_,
            [this](std::vector<std::unique_ptr<StepTask>> chunks) {
              QueueChunks(std::move(chunks));
            },
            metrics_, options_.statistics));
      } catch (const std::bad_alloc&) {  // the request stays, computed whole
      }
    }
    if (!work->projections.empty()) {
      metrics_.split_requests->Increment();
      const absl::Time now = clock_.Now();
      oldest.waited = now - oldest.enqueued;
      metrics_.queue_duration->Observe(absl::ToDoubleSeconds(oldest.waited));
      queued_tokens_ -= oldest.input().tokens();
      queued_bytes_ -= oldest.input().wire_bytes();
      queue_.pop_front();  // moved into the split (`oldest` is gone)
      PublishDepth();
      return Hand(std::move(work));
    }
    work->batch = TakeBatch();
    return Hand(std::move(work));
  }
  if (work->steps) return Hand(std::move(work));  // steps do not wait for the memory
  const bool unwanted = clock_.Now() > oldest.deadline || oldest.Cancelled();
  if (!unwanted && growth == MemoryBudget::Growth::kFullUntilActiveReturns) {
    // Batches computing or answering will give memory back.
    idle.waiting_for_memory = true;
    return nullptr;
  }
  // Nothing will give memory back (queued requests hold it), or nobody
  // waits for this one any more: it leaves alone, and Compute drops it.
  if (!unwanted) {
    oldest.refusal = absl::ResourceExhaustedError(
        absl::StrCat("server memory budget full: requests waiting hold ",
                     WithCommas(options_.memory->reserved()), " of ",
                     WithCommas(options_.memory->capacity()), " bytes and this one needs ",
                     WithCommas(oldest.active_bytes), " more to compute; retry later"));
  }
  if (options_.memory != nullptr) options_.memory->MarkLeaving(*oldest.memory);
  queued_tokens_ -= oldest.input().tokens();
  queued_bytes_ -= oldest.input().wire_bytes();
  work->batch.push_back(std::move(queue_.front()));
  queue_.pop_front();
  PublishDepth();
  return Hand(std::move(work));
}

// With mu_ held, the oldest request's active memory reserved.
std::vector<std::unique_ptr<AttendCall>> Batcher::TakeBatch() {
  // The oldest request sets the signature; compatible ones join in order
  // while the batch has room, in tokens and in memory. Requests of another
  // signature are passed over, however large.
  std::vector<std::unique_ptr<AttendCall>> batch;
  const BatchSignature signature = queue_.front()->signature();
  const int64_t limit = TokenLimit();
  int64_t tokens = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (!((*it)->signature() == signature)) {
      ++it;
      continue;
    }
    const bool fits =
        batch.empty() || (options_.enabled && tokens + (*it)->input().tokens() <= limit);
    if (!fits) break;
    if (!batch.empty() && ReserveActive(**it) != MemoryBudget::Growth::kGrown) break;
    tokens += (*it)->input().tokens();
    queued_tokens_ -= (*it)->input().tokens();
    queued_bytes_ -= (*it)->input().wire_bytes();
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
    if (!options_.enabled) break;
  }
  PublishDepth();
  return batch;
}

int Batcher::MaxThreadsPerCall() const { return pool_.MaxThreadsPerCall(); }

void Batcher::RunProjections(std::vector<std::unique_ptr<ProjectionTask>> projections,
                             Workspace& ws) {
  const absl::Time now = clock_.Now();
  for (auto& p : projections) {
    if (absl::Status unwanted = Unwanted(*p, now); !unwanted.ok()) {
      p->Fail(unwanted);
    } else {
      p->Run(ws);
    }
    p.reset();  // its memory comes back before the next one runs
  }
  WakeLeftSteps(/*ran_some=*/true, /*more=*/false);
}

Batcher::StepTaken Batcher::TryStartStep(std::unique_ptr<StepTask>& step, bool call_empty,
                                         StepPlan& plan) {
  absl::Status why;
  switch (step->Begin(plan, why)) {
    case StepTask::Start::kWait:
      return StepTaken::kBusy;
    case StepTask::Start::kRefused:
      step->refusal = std::move(why);
      return StepTaken::kRefused;
    case StepTask::Start::kRun:
      break;
  }
  // Started: a refusal from here gives the session back first, under this
  // lock, so that its next step may start in this call or the next.
  absl::Status refusal;
  bool no_room = false;
  try {
    refusal = AdmitStartedStep(*step, call_empty, no_room);
  } catch (...) {
    step->Abandon();
    throw;
  }
  if (refusal.ok() && !no_room) return StepTaken::kTaken;
  step->Abandon();
  if (no_room) return StepTaken::kNoRoom;
  step->refusal = std::move(refusal);
  return StepTaken::kRefused;
}

absl::Status Batcher::AdmitStartedStep(StepTask& step, bool call_empty, bool& no_room) {
  MemoryBudget* memory = options_.memory;
  if (memory != nullptr) {
    const RequestCost cost{.queued_bytes = step.queued_bytes, .active_bytes = step.active_bytes};
    absl::Status fits = CheckStepMemory(cost, memory->capacity());
    if (fits.ok() && ReserveActive(step) != MemoryBudget::Growth::kGrown) {
      // It may fit once the steps of this call are done.
      if (!call_empty) {
        no_room = true;
        return absl::OkStatus();
      }
      // A step does not wait for memory behind Attend requests.
      fits = absl::ResourceExhaustedError(absl::StrCat(
          "server memory budget full: requests in flight hold ", WithCommas(memory->reserved()),
          " of ", WithCommas(memory->capacity()), " bytes and this step needs ",
          WithCommas(step.active_bytes), " more to compute; retry later"));
    }
    if (!fits.ok()) {
      step.CountDropped(metrics_, "memory");
      return fits;
    }
  }
  return step.Allocate();
}

std::vector<Batcher::StartedStep> Batcher::TakeSteps(std::vector<std::unique_ptr<Task>>& refused,
                                                     bool& more) {
  MutexLock lock(mu_);
  const absl::Time now = clock_.Now();
  // Room made first: once a step has started, nothing here allocates.
  std::vector<StartedStep> started;
  std::vector<const void*> blocked;  // sessions whose later steps wait
  started.reserve(steps_.size());
  blocked.reserve(steps_.size());
  refused.reserve(refused.size() + steps_.size());
  auto is_blocked = [&](const void* session) {
    return std::find(blocked.begin(), blocked.end(), session) != blocked.end();
  };
  int64_t tokens = 0, attend_rows = 0;
  for (auto it = steps_.begin(); it != steps_.end();) {
    StepTask& step = **it;
    if (is_blocked(step.session())) {
      ++it;
      continue;
    }
    if (absl::Status unwanted = Unwanted(step, now); !unwanted.ok()) {
      step.refusal = std::move(unwanted);
      RefuseWaitingStep(it, refused);
      continue;
    }
    // One step per session and call; a step that stays keeps its
    // session's later steps behind it.
    // Chunks of long Attend requests share the call's Attend cap: at most
    // one chunk's rows beside the steps.
    const bool over_cap =
        step.attend_rows() && attend_rows > 0 && attend_rows + step.tokens() > tokens_with_steps_;
    if ((!started.empty() && tokens + step.tokens() > max_batch_tokens_) || over_cap) {
      more = true;
      blocked.push_back(step.session());
      ++it;
      continue;
    }
    StepPlan plan;
    switch (TryStartStep(*it, started.empty(), plan)) {
      case StepTaken::kBusy:
        blocked.push_back(step.session());
        ++it;
        continue;
      case StepTaken::kNoRoom:
        more = true;
        blocked.push_back(step.session());
        ++it;
        continue;
      case StepTaken::kRefused:
        RefuseWaitingStep(it, refused);
        continue;
      case StepTaken::kTaken:
        blocked.push_back(step.session());
        break;
    }
    tokens += step.tokens();
    if (step.attend_rows()) attend_rows += step.tokens();
    queued_bytes_ -= step.wire_bytes;
    step.waited = now - step.enqueued;
    started.push_back({std::move(*it), plan});
    it = steps_.erase(it);
  }
  PublishDepth();
  return started;
}

void Batcher::RefuseWaitingStep(std::deque<std::unique_ptr<StepTask>>::iterator& it,
                                std::vector<std::unique_ptr<Task>>& refused) {
  StepTask& step = **it;
  if (options_.memory != nullptr) options_.memory->MarkLeaving(*step.memory);
  queued_bytes_ -= step.wire_bytes;
  refused.push_back(std::move(*it));
  it = steps_.erase(it);
}

void Batcher::WakeSteps() { WakeLeftSteps(/*ran_some=*/true, /*more=*/false); }

void Batcher::WakeLeftSteps(bool ran_some, bool more) {
  if (!ran_some && !more) return;
  {
    MutexLock lock(mu_);
    if (steps_.empty()) return;
    steps_ready_ = true;
  }
  pool_.Wake(registration_, /*steps=*/true);
}

void Batcher::Compute(std::vector<std::unique_ptr<AttendCall>> batch, bool steps, Workspace& ws) {
  // Drop what nobody waits for any more, before spending compute on it.
  const absl::Time now = clock_.Now();
  std::vector<std::unique_ptr<AttendCall>> live;
  for (std::unique_ptr<AttendCall>& r : batch) {
    r->waited = now - r->enqueued;
    metrics_.queue_duration->Observe(absl::ToDoubleSeconds(r->waited));
    if (!r->refusal.ok()) {
      r->CountDropped(metrics_, "memory");
      r->Fail(r->refusal);
    } else if (absl::Status unwanted = Unwanted(*r, now); !unwanted.ok()) {
      r->Fail(unwanted);
    } else {
      live.push_back(std::move(r));
    }
  }
  std::vector<StartedStep> started;
  bool more = false, refusals = false;
  if (steps) {
    std::vector<std::unique_ptr<Task>> refused;
    try {
      started = TakeSteps(refused, more);
    } catch (const std::bad_alloc&) {  // nothing started; they wait for the next call
      more = true;
    }
    refusals = !refused.empty();
    for (auto& step : refused) step->Fail(step->refusal);  // outside the lock
  }
  size_t answered = 0;
  if (!live.empty() || !started.empty()) {
    try {
      ComputeLive(live, started, ws, answered);
    } catch (const std::bad_alloc&) {  // the call fails, the server goes on
      const absl::Status status = absl::ResourceExhaustedError(
          "out of memory while computing this request's batch; retry later");
      for (size_t i = answered; i < started.size() + live.size(); ++i) {
        if (i < started.size()) {
          started[i].task->Finish(status, {}, {});
        } else {
          live[i - started.size()]->Fail(status);
        }
      }
    }
  }
  const bool ran_steps = !started.empty();
  started.clear();  // their memory and sessions' blocks come back first
  // Refused steps freed their sessions too: the steps behind them may go.
  WakeLeftSteps(ran_steps || refusals, more);
}

void Batcher::ReportPrimitiveCacheMisses() {
  const uint64_t now = engine_.PrimitiveCacheMisses();
  uint64_t reported = reported_misses_.load();
  while (now > reported && !reported_misses_.compare_exchange_weak(reported, now)) {
  }
  if (now > reported)
    metrics_.primitive_cache_misses->Increment(static_cast<double>(now - reported));
}

void Batcher::ComputeLive(const std::vector<std::unique_ptr<AttendCall>>& live,
                          std::vector<StartedStep>& steps, Workspace& ws, size_t& answered) {
  const absl::Time merging = absl::Now();
  std::vector<const AttentionRequest*> inputs;
  int64_t tokens = 0;
  for (const auto& r : live) {
    inputs.push_back(&r->input());
    tokens += r->input().tokens();
  }
  // The steps' query rows go right after the requests' (one buffer, one
  // projection product, no copy in the engine).
  std::vector<float> step_query;
  AppendBatch step_batch;
  bool step_weights_wanted = false;
  for (const StartedStep& s : steps) {
    step_query.insert(step_query.end(), s.plan.query.begin(), s.plan.query.end());
    step_batch.steps.push_back(s.plan.step);
    step_weights_wanted |= s.plan.need_weights;
  }
  step_batch.query = step_query;
  std::optional<RaggedBatch> merged;
  if (!live.empty()) {
    merged.emplace(inputs, step_batch.query);
    if (!steps.empty()) step_batch.query = merged->rows_after();
  }
  static const AttentionBatch kNoSequences;
  const int64_t request_elements = merged ? merged->output_elements() : 0;
  const int64_t step_elements = static_cast<int64_t>(step_batch.query.size());
  const int64_t step_weights_elements =
      step_weights_wanted ? engine_.AppendWeightsElements(step_batch) : 0;
  // Every element is written by the engine: no zero-fill.
  const std::unique_ptr<float[]> output(new float[request_elements + step_elements]);
  const std::unique_ptr<float[]> weights(new float[merged ? merged->weights_elements() : 0]);
  const std::unique_ptr<float[]> step_weights(new float[step_weights_elements]);
  const absl::Span<float> all_output(output.get(), request_elements);
  const absl::Span<float> all_weights(weights.get(), merged ? merged->weights_elements() : 0);
  const MixedOutputs out{absl::MakeSpan(output.get(), request_elements + step_elements),
                         all_weights, merged && merged->per_head_weights(),
                         absl::MakeSpan(step_weights.get(), step_weights_elements)};
  const absl::Time start = absl::Now();
  const absl::Status status =
      engine_.Compute(merged ? merged->batch() : kNoSequences, step_batch, out, ws);
  const absl::Time computed = absl::Now();
  metrics_.compute_duration->Observe(absl::ToDoubleSeconds(computed - start));
  ReportPrimitiveCacheMisses();
  // The requests' answers are encoded, then the call's statistics recorded
  // in one step, before any answer leaves.
  std::vector<absl::Status> answers(live.size(), status);
  if (status.ok()) {
    for (size_t i = 0; i < live.size(); ++i) {
      const AttentionResult result{merged->OutputOf(i, all_output),
                                   merged->WeightsOf(i, all_weights)};
      answers[i] =
          FirstNonFinite(result.output) >= 0  // finite inputs that overflow f32
              ? absl::InvalidArgumentError(
                    "inputs too large: the attention overflows float32 (non-finite result)")
              : live[i]->Prepare(result);
    }
    RecordCall(live, answers, steps, merging, start, computed);
  }
  // The steps first. If an answer throws (out of memory), Compute fails
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

void Batcher::RecordCall(const std::vector<std::unique_ptr<AttendCall>>& live,
                         const std::vector<absl::Status>& answers,
                         const std::vector<StartedStep>& steps, absl::Time merging,
                         absl::Time start, absl::Time computed) {
  if (options_.statistics == nullptr) return;
  ModelStatistics::Call call;
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < live.size(); ++i) {
    AttendCall& r = *live[i];
    if (r.statistics == nullptr) continue;
    ++call.batch_requests;
    call.batch_sequences += static_cast<uint64_t>(r.input().sequences());
    if (!answers[i].ok()) continue;
    call.AddAnswer(now - r.arrived, r.waited, r.input().sequences());
    r.counted = true;
  }
  // A session step is a request of one sequence (a chunk of a long
  // request is not counted: its request is, when its last chunk is done).
  for (const StartedStep& s : steps) {
    if (s.task->statistics == nullptr) continue;
    ++call.batch_requests;
    ++call.batch_sequences;
    call.AddAnswer(now - s.task->arrived, s.task->waited, 1);
    s.task->counted = true;
  }
  call.input = start - merging;
  call.infer = computed - start;
  call.output = now - computed;
  options_.statistics->Record(call);
}

}  // namespace mha::server
