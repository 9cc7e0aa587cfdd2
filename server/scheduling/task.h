// What the scheduler queues: one task type for every kind of work (an
// Attend request, a session step, a cross session's memory projection),
// each with its cost, deadline, cancellation and priority, admitted through
// one path (Batcher::Enqueue) and answered exactly once.
#ifndef MHA_SERVER_SCHEDULING_TASK_H_
#define MHA_SERVER_SCHEDULING_TASK_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/step_batch.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/memory_budget.h"

namespace mha {
class Workspace;
}  // namespace mha

namespace mha::server {

// The rule every answer keeps: a call is answered exactly once (the first
// answer wins, later ones do nothing) and a failure is never OK. One per
// task; not thread-safe (its task's owner answers).
class AnswerOnce {
 public:
  // True the first time: the caller answers now. False after.
  bool Claim() {
    if (answered_) return false;
    answered_ = true;
    return true;
  }
  bool answered() const { return answered_; }
  // `status` as a failure: INTERNAL when it is OK.
  static absl::Status AsFailure(const absl::Status& status) {
    return status.ok() ? absl::InternalError("a call failed with OK") : status;
  }

 private:
  bool answered_ = false;
};

// Owns what one unit of work holds while the scheduler has it: its memory
// reservation (shared with the transport, so it comes back when both the
// computing and the sending of the answer are done), its deadline and
// priority. Subclasses say what it computes and how it is answered. Not
// thread-safe: one owner at a time (front end, queue, worker).
class Task {
 public:
  enum class Kind { kAttend, kStep, kProjection };

  explicit Task(Kind kind) : kind_(kind) {}
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  virtual ~Task() = default;

  Kind kind() const { return kind_; }
  // Whether nobody waits for the answer any more (the client cancelled).
  virtual bool Cancelled() const { return false; }
  // Answers with an error (never OK), once; later answers do nothing.
  virtual void Fail(const absl::Status& status) = 0;
  // A refusal before compute, counted by `reason` (memory, deadline,
  // cancelled, queue_full) where this kind of task is counted: Attend
  // requests in their model's metrics, steps in the sessions' metrics.
  virtual void CountDropped(const ModelMetrics& model, const char* reason) = 0;

  absl::Time deadline = absl::InfiniteFuture();
  // The priority level the caller asked for (Triton's rule: 1 is the
  // highest; 0: the model's default); the batcher makes it the level it
  // queues at. Steps and projections go before Attend requests whatever it is.
  uint64_t priority = 0;
  absl::Time enqueued;
  // Every worker was in an engine call when it was queued: it waited behind
  // a running call (else for a worker to wake and take it).
  bool queued_behind_calls = false;
  // The bytes it arrived in (the queue's byte limit counts them).
  int64_t wire_bytes = 0;
  // What it holds while queued and what computing and answering it adds
  // (server/scheduling/admission.h). A step's active bytes depend on its
  // session's position: set when it starts (StepTask::Begin).
  int64_t queued_bytes = 0, active_bytes = 0;
  std::shared_ptr<MemoryReservation> memory = std::make_shared<MemoryReservation>();
  absl::Status refusal;  // set when the batcher refuses it instead of computing

  // Where it is counted when it is an inference (an Attend request or a
  // session step; null for a chunk of a request, a projection, or a model
  // the server does not have): its answer OK with its engine call's figures
  // (ModelStatistics::Record, by the batcher), a failure once, when it is
  // answered (CountFailure).
  ModelStatistics* statistics = nullptr;
  absl::Time arrived = absl::Now();  // when its front end received it
  absl::Duration waited;             // in the queue, set as it leaves it
  // Counted as answered OK in its engine call's record: if its answer
  // fails after all (out of memory sending it), it is not counted twice.
  bool counted = false;

 protected:
  // Counts a failed answer; its subclass calls it once, as it answers.
  void CountFailure() const {
    if (statistics != nullptr && !counted) statistics->RecordFailure(absl::Now() - arrived);
  }

 private:
  const Kind kind_;
};

// What a started step gives the engine call, valid until Finish.
struct StepPlan {
  CacheStep step;                 // its cache (room reserved), tokens, cross
  absl::Span<const float> query;  // [tokens, embed_dim] f32
  bool need_weights = false;
  int64_t keys = 0;  // what its weights row spans after the step
};

// A session step. Steps of one session run in the order they were queued,
// one per engine call. The scheduler asks the session's owner (through
// Begin) whether it may run now; the owner allocates its cache blocks.
// Lock order: Begin, Allocate and Abandon are called with the batcher's
// lock held (Batcher::mu_) and take the owner's (SessionManager::mu_)
// inside it; the owner never calls into a batcher while holding its own.
class StepTask : public Task {
 public:
  StepTask() : Task(Kind::kStep) {}

  // Which session it steps (steps of one session wait for each other).
  virtual const void* session() const = 0;
  virtual int64_t tokens() const = 0;
  // Whether its rows are an Attend request's (a chunk of a long one): they
  // count against the call's cap on Attend tokens while sessions step.
  virtual bool attend_rows() const { return false; }

  enum class Start {
    kRun,      // started: its session is its own until Finish or Fail;
               // `plan` and active_bytes are set
    kBusy,     // its session is computing another step: ask again later
    kRefused,  // `why` says why; Fail it
  };
  // Asked as a call is formed, after the scheduler's own checks.
  virtual Start Begin(StepPlan& plan, absl::Status& why) = 0;
  // After Begin and once its working memory is reserved: the cache blocks
  // its tokens need (the owner may evict idle sessions for them), or why
  // not (then Fail it).
  virtual absl::Status Allocate() = 0;
  // Undoes Begin when the call cannot take it after all (its memory is not
  // there yet): it waits in the queue again.
  virtual void Abandon() = 0;
  // After the engine call: its status and the step's output rows and
  // weights (views valid during the call). Answers, once.
  virtual void Finish(const absl::Status& status, absl::Span<const float> output,
                      absl::Span<const float> weights) = 0;
};

// Work that needs an engine workspace outside an engine call (a cross
// session's memory projection); runs alone, before the next call.
class ProjectionTask : public Task {
 public:
  ProjectionTask() : Task(Kind::kProjection) {}
  // Computes and answers.
  virtual void Run(Workspace& ws) = 0;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_TASK_H_
