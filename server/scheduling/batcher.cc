#include "server/scheduling/batcher.h"

#include <new>
#include <utility>

#include "engine/mha_engine.h"

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
    : options_(options),
      metrics_(metrics),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      own_pool_(OwnPool(options)),
      pool_(options.pool != nullptr ? *options.pool : *own_pool_),
      tokens_(CallTokens::Resolve(options_, pool_.MaxThreadsPerCall())),
      runner_(engine, metrics, clock_, options.statistics),
      starter_(options_, tokens_, metrics),
      lanes_(std::move(model), options_, metrics),
      former_(
          engine, options_, tokens_, metrics, clock_, [this] { return pool_.StepsRecently(); },
          [this](std::vector<std::unique_ptr<StepTask>> chunks) {
            QueueChunks(std::move(chunks));
          }) {
  registration_ = pool_.Attach(this);
}

Batcher::~Batcher() {
  Stop();
  pool_.Detach(registration_);
}

void Batcher::Enqueue(std::unique_ptr<Task> task) {
  const bool step = task->kind() == Task::Kind::kStep;
  const bool projection = task->kind() == Task::Kind::kProjection;
  absl::Status admitted;
  // Before the step is in the lanes: a worker woken by earlier requests
  // may find it there, and must form that call under the steps' cap.
  if (step) pool_.NoteStepsArrive();
  try {
    MutexLock lock(mu_);
    // A stopped batcher (its version retired, or the server past its grace
    // period) takes nothing. Draining is not checked here: new work is
    // refused at the front-end gate (FrontEndGate::Admit), and what passed
    // it is served.
    if (stopping_) {
      admitted = absl::UnavailableError("server is shutting down");
    } else {
      task->queued_behind_calls = pool_.AllWorkersBusy();
      admitted = lanes_.Admit(task, clock_.Now());
    }
  } catch (const std::bad_alloc&) {  // the queue could not grow: nothing changed
    admitted = absl::ResourceExhaustedError("out of memory queueing the request; retry later");
  }
  if (!admitted.ok()) {
    task->Fail(admitted);  // outside the lock
    // Steps of the session it would have opened wait for it: they are
    // refused now.
    if (projection) WakeLeftSteps(/*ran_some=*/true, /*more=*/false);
    return;
  }
  pool_.Wake(registration_, step);
}

void Batcher::Stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  pool_.Wake(registration_);  // what is queued goes now
  MutexLock lock(mu_);
  while (!lanes_.empty() || in_flight_ != 0) drained_cv_.Wait(lock);
}

void Batcher::QueueChunks(std::vector<std::unique_ptr<StepTask>> chunks) {
  pool_.NoteStepsArrive();  // as for a step (Enqueue)
  {
    MutexLock lock(mu_);
    lanes_.AddChunks(chunks, clock_.Now());
  }
  pool_.Wake(registration_, /*steps=*/true);
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

bool Batcher::Work::MayYield() const {
  if (!call.projections.empty()) return true;
  int64_t rows = 0;
  for (const auto& r : call.batch) rows += r->input().rows() * r->input().q_len();
  return rows > batcher.tokens_.with_steps;
}

bool Batcher::StepsReady() {
  MutexLock lock(mu_);
  return lanes_.steps_ready();
}

bool Batcher::Empty() {
  MutexLock lock(mu_);
  return lanes_.requests().empty() && !lanes_.has_projections() && !lanes_.steps_ready();
}

std::unique_ptr<PoolWork> Batcher::PollSteps() {
  MutexLock lock(mu_);
  if (!lanes_.steps_ready()) return nullptr;
  auto work = std::make_unique<Work>(*this);  // may throw: then nothing changed
  lanes_.TakeStepsReady();
  work->call.steps = true;
  work->in_yield = true;
  return Hand(std::move(work));
}

std::unique_ptr<PoolWork> Batcher::Poll(Idle& idle) {
  MutexLock lock(mu_);
  // Made first: once tasks leave the lanes, nothing allocates.
  auto work = std::make_unique<Work>(*this);
  if (!former_.Form(lanes_, stopping_, work->call, idle)) return nullptr;
  return Hand(std::move(work));
}

void Batcher::RunCall(CallPlan& call, bool in_yield, Workspace& ws) {
  if (in_yield) metrics_.yielded_step_calls->Increment();
  if (!call.projections.empty()) {
    runner_.RunProjections(std::move(call.projections), ws);
    WakeLeftSteps(/*ran_some=*/true, /*more=*/false);
  }
  if (call.batch.empty() && !call.steps) return;
  // Drop what nobody waits for any more, before spending compute on it.
  const std::vector<std::unique_ptr<AttendCall>> live = runner_.DropUnwanted(std::move(call.batch));
  std::vector<StartedStep> started;
  bool more = false, refusals = false;
  if (call.steps) {
    std::vector<std::unique_ptr<Task>> refused;
    try {
      MutexLock lock(mu_);
      // Lock order: mu_, then the sessions' owner's (StepStarter).
      started = starter_.TakeSteps(lanes_, mu_, clock_.Now(), refused, more);
    } catch (const std::bad_alloc&) {  // nothing started; they wait for the next call
      more = true;
    }
    refusals = !refused.empty();
    for (auto& step : refused) step->Fail(step->refusal);  // outside the lock
  }
  runner_.Run(live, started, ws);
  const bool ran_steps = !started.empty();
  started.clear();  // their memory and sessions' blocks come back first
  // Refused steps freed their sessions too: the steps behind them may go.
  WakeLeftSteps(ran_steps || refusals, more);
}

void Batcher::WakeSteps() { WakeLeftSteps(/*ran_some=*/true, /*more=*/false); }

void Batcher::WakeLeftSteps(bool ran_some, bool more) {
  if (!ran_some && !more) return;
  {
    MutexLock lock(mu_);
    if (!lanes_.MarkStepsReady()) return;
  }
  pool_.Wake(registration_, /*steps=*/true);
}

int Batcher::MaxThreadsPerCall() const { return pool_.MaxThreadsPerCall(); }

}  // namespace mha::server
