#include "server/scheduling/call_former.h"

#include <new>
#include <utility>

#include "server/scheduling/admission.h"

namespace mha::server {

CallFormer::CallFormer(const MhaEngine& engine, const BatcherOptions& options, CallTokens tokens,
                       const ModelMetrics& metrics, const Clock& clock,
                       std::function<bool()> sessions_step, QueueChunks queue_chunks)
    : engine_(engine),
      options_(options),
      tokens_(tokens),
      metrics_(metrics),
      clock_(clock),
      sessions_step_(std::move(sessions_step)),
      queue_chunks_(std::move(queue_chunks)) {}

bool CallFormer::Form(TaskLanes& lanes, bool stopping, CallPlan& call, PoolQueue::Idle& idle) {
  if (lanes.has_projections()) {
    call.projections = lanes.TakeProjections();
    return true;
  }
  call.steps = lanes.TakeStepsReady();
  if (!BatchReady(lanes, call.steps, stopping)) {
    if (!call.steps && !lanes.requests().empty()) {
      idle.retry_at = lanes.requests().front()->enqueued + options_.max_queue_delay;
    }
    return call.steps;  // steps alone, or nothing yet
  }
  // A request with more query rows than the cap that cannot go in chunks
  // carries no steps (they would wait for all of it): ready steps go alone
  // before it, once; then it goes alone, and the steps stay ready for
  // another worker or its call's yields.
  bool leave_steps = false;
  if (call.steps && RunsWholeBesideSteps(lanes)) {
    if (passed_over_ != lanes.requests().front().get()) {
      passed_over_ = lanes.requests().front().get();
      return true;  // steps alone; the request stays first
    }
    leave_steps = true;
  }
  // The oldest request first gets the memory to compute and answer it.
  const MemoryBudget::Growth growth = ReserveActive(options_.memory, *lanes.requests().front());
  if (growth != MemoryBudget::Growth::kGrown) {
    if (call.steps) return true;  // steps do not wait for the memory
    return TakeRefused(lanes, growth, call, idle);
  }
  if (leave_steps) {
    call.steps = false;
    lanes.MarkStepsReady();
  }
  if (!TakeSplit(lanes, call)) call.batch = TakeBatch(lanes);
  return true;
}

int64_t CallFormer::TokenLimit() const {
  return sessions_step_() ? tokens_.with_steps : tokens_.max;
}

// A batch may close: it is full, its oldest request waited long enough, or
// batching is off, or the batcher is stopping, or session steps go now.
bool CallFormer::BatchReady(const TaskLanes& lanes, bool steps, bool stopping) const {
  if (lanes.requests().empty()) return false;
  if (steps || stopping || !options_.enabled) return true;
  if (clock_.Now() - lanes.requests().front()->enqueued >= options_.max_queue_delay) return true;
  const int64_t limit = TokenLimit();
  return lanes.queued_tokens() >= limit && TokensJoiningOldest(lanes, limit) >= limit;
}

int64_t CallFormer::TokensJoiningOldest(const TaskLanes& lanes, int64_t limit) const {
  const BatchSignature& signature = lanes.requests().front()->signature();
  int64_t tokens = 0;
  for (const auto& r : lanes.requests()) {
    if (r->signature() == signature) tokens += r->input().tokens();
    if (tokens >= limit) break;
  }
  return tokens;
}

bool CallFormer::SplitsOldest(const TaskLanes& lanes) const {
  const AttentionRequest& oldest = lanes.requests().front()->input();
  return options_.enabled && tokens_.with_steps < tokens_.max && sessions_step_() &&
         oldest.q_len() > tokens_.with_steps && Splittable(oldest, engine_);
}

bool CallFormer::RunsWholeBesideSteps(const TaskLanes& lanes) const {
  const AttentionRequest& oldest = lanes.requests().front()->input();
  return options_.enabled && tokens_.with_steps < tokens_.max && sessions_step_() &&
         oldest.rows() * oldest.q_len() > tokens_.with_steps && !SplitsOldest(lanes);
}

std::vector<std::unique_ptr<AttendCall>> CallFormer::TakeBatch(TaskLanes& lanes) const {
  // The oldest request sets the signature; compatible ones join in order
  // while the batch has room, in tokens and in memory. Requests of another
  // signature are passed over, however large.
  std::vector<std::unique_ptr<AttendCall>> batch;
  const BatchSignature signature = lanes.requests().front()->signature();
  const int64_t limit = TokenLimit();
  int64_t tokens = 0;
  for (size_t i = 0; i < lanes.requests().size();) {
    AttendCall& next = *lanes.requests()[i];
    if (!(next.signature() == signature)) {
      ++i;
      continue;
    }
    const int64_t next_tokens = next.input().tokens();
    const bool fits = batch.empty() || (options_.enabled && tokens + next_tokens <= limit);
    if (!fits) break;
    if (!batch.empty() && ReserveActive(options_.memory, next) != MemoryBudget::Growth::kGrown) {
      break;
    }
    tokens += next_tokens;
    batch.emplace_back();  // may throw: then the request stays queued
    batch.back() = lanes.TakeRequest(i);
    if (!options_.enabled) break;
  }
  return batch;
}

bool CallFormer::TakeSplit(TaskLanes& lanes, CallPlan& call) const {
  if (!SplitsOldest(lanes)) return false;
  AttendCall& oldest = *lanes.requests().front();  // lives on in the split
  std::unique_ptr<ProjectionTask> split;
  try {
    call.projections.reserve(1);
    split = lanes.SplitOldest([&](std::unique_ptr<AttendCall>& request) {
      return SplitAttendCall(request, engine_, tokens_.with_steps, queue_chunks_, metrics_,
                             options_.statistics);
    });
  } catch (const std::bad_alloc&) {  // the request stays, computed whole
    return false;
  }
  call.projections.push_back(std::move(split));
  metrics_.split_requests->Increment();
  oldest.waited = clock_.Now() - oldest.enqueued;
  metrics_.queue_duration->Observe(absl::ToDoubleSeconds(oldest.waited));
  return true;
}

bool CallFormer::TakeRefused(TaskLanes& lanes, MemoryBudget::Growth growth, CallPlan& call,
                             PoolQueue::Idle& idle) const {
  AttendCall& oldest = *lanes.requests().front();
  const bool unwanted = clock_.Now() > oldest.deadline || oldest.Cancelled();
  if (!unwanted && growth == MemoryBudget::Growth::kFullUntilActiveReturns) {
    // Calls computing or answering will give memory back.
    idle.waiting_for_memory = true;
    return false;
  }
  // Nothing will give memory back (queued requests hold it), or nobody
  // waits for this one any more: it leaves alone, and its call drops it.
  if (!unwanted) {
    oldest.refusal = MemoryBudgetFull(options_.memory->reserved(), options_.memory->capacity(),
                                      "request", oldest.active_bytes, "more to compute");
  }
  call.batch.emplace_back();  // may throw: then the request stays queued
  if (options_.memory != nullptr) options_.memory->MarkLeaving(*oldest.memory);
  call.batch.back() = lanes.TakeRequest(0);
  return true;
}

}  // namespace mha::server
