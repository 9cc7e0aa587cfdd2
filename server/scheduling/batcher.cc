#include "server/scheduling/batcher.h"

#include <algorithm>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
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
      return "encoder memory";
  }
  return "task";
}

}  // namespace

absl::Status Batcher::Admit(std::unique_ptr<Task>& task) {
  MutexLock lock(mu_);
  // A stopped batcher (its version retired, or the server past its grace
  // period) takes nothing. Draining is not checked here: new work is
  // refused at the front-end gate (FrontEndGate::Admit), and what passed it
  // is served.
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
  // Its working memory (a step's as of its session's position now) against
  // the whole budget, then against what is free.
  if (memory != nullptr) {
    if (absl::Status fits = CheckFitsBudget(*task, memory->capacity()); !fits.ok()) {
      task->CountDropped(metrics_, "memory");
      return fits;
    }
  }
  if (memory != nullptr && !memory->TryReserveQueued(task->queued_bytes, *task->memory)) {
    task->CountDropped(metrics_, "memory");
    return MemoryBudgetFull(memory->reserved(), memory->capacity(), Noun(*task), task->queued_bytes,
                            "to wait in the queue");
  }
  task->enqueued = clock_.Now();
  task->queued_behind_calls = pool_.AllWorkersBusy();
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

absl::Status Batcher::Unwanted(Task& task, absl::Time now, const char* stage) const {
  // gRPC cancels a call whose deadline passed, by its own clock, which may
  // run a little ahead of ours: a cancellation that close to the deadline
  // is the deadline's.
  constexpr absl::Duration kClockSlack = absl::Milliseconds(100);
  const bool cancelled = task.Cancelled();
  if (now > task.deadline || (cancelled && now + kClockSlack > task.deadline)) {
    task.CountDropped(metrics_, "deadline");
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while the ", Noun(task), " was ", stage));
  }
  if (cancelled) {
    task.CountDropped(metrics_, "cancelled");
    return absl::CancelledError("client cancelled the request");
  }
  return absl::OkStatus();
}

bool Batcher::NobodyWaits(const std::vector<std::unique_ptr<AttendCall>>& live,
                          size_t& first_wanted) const {
  const absl::Time now = clock_.Now();
  while (first_wanted < live.size() &&
         (live[first_wanted]->Cancelled() || now > live[first_wanted]->deadline)) {
    ++first_wanted;
  }
  return first_wanted == live.size();
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

bool Batcher::RunsWholeBesideSteps() const {
  const AttentionRequest& oldest = queue_.front()->input();
  return options_.enabled && tokens_with_steps_ < max_batch_tokens_ && pool_.StepsRecently() &&
         oldest.rows() * oldest.q_len() > tokens_with_steps_ && !SplitsOldest();
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
  if (in_yield) batcher.metrics_.yielded_step_calls->Increment();
  if (!projections.empty()) batcher.RunProjections(std::move(projections), ws);
  if (!batch.empty() || steps) batcher.Compute(std::move(batch), steps, ws);
}

bool Batcher::Work::MayYield() const {
  if (!projections.empty()) return true;
  int64_t rows = 0;
  for (const auto& r : batch) rows += r->input().rows() * r->input().q_len();
  return rows > batcher.tokens_with_steps_;
}

bool Batcher::StepsReady() {
  MutexLock lock(mu_);
  return steps_ready_;
}

bool Batcher::Empty() {
  MutexLock lock(mu_);
  return queue_.empty() && projections_.empty() && !steps_ready_;
}

std::unique_ptr<PoolWork> Batcher::PollSteps() {
  MutexLock lock(mu_);
  if (!steps_ready_) return nullptr;
  auto work = std::make_unique<Work>(*this);  // may throw: then nothing changed
  steps_ready_ = false;
  work->steps = true;
  work->in_yield = true;
  return Hand(std::move(work));
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
  // A request with more query rows than the cap that cannot go in chunks
  // carries no steps (they would wait for all of it): ready steps go alone
  // before it, once; then it goes alone, and the steps stay ready for
  // another worker or its call's yields.
  bool leave_steps = false;
  if (work->steps && RunsWholeBesideSteps()) {
    if (passed_over_ != queue_.front().get()) {
      passed_over_ = queue_.front().get();
      return Hand(std::move(work));  // steps alone; the request stays first
    }
    leave_steps = true;
  }
  // The oldest request first gets the memory to compute and answer it.
  AttendCall& oldest = *queue_.front();
  const MemoryBudget::Growth growth = ReserveActive(oldest);
  if (growth == MemoryBudget::Growth::kGrown) {
    if (leave_steps) {
      work->steps = false;
      steps_ready_ = true;
    }
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
    oldest.refusal = MemoryBudgetFull(options_.memory->reserved(), options_.memory->capacity(),
                                      "request", oldest.active_bytes, "more to compute");
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

}  // namespace mha::server
