// The dynamic ragged batcher: merges concurrent requests of one model into
// one engine call, back to back, never padded.
#ifndef MHA_SERVER_SCHEDULING_BATCHER_H_
#define MHA_SERVER_SCHEDULING_BATCHER_H_

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/mutex.h"
#include "engine/ragged_batch.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/memory_budget.h"
#include "server/scheduling/task.h"
#include "server/scheduling/worker_pool.h"

namespace mha {
class MhaEngine;
class Workspace;
}  // namespace mha

namespace mha::server {

struct BatcherOptions {
  // The default max_batch_tokens per thread of an engine call: each
  // thread's share of a batch's activations stays near its L2 cache.
  static constexpr int64_t kTokensPerThread = 1024;

  bool enabled = true;  // false: one request per engine call
  // Query + key tokens per engine call; 0: kTokensPerThread per thread.
  int64_t max_batch_tokens = 0;
  // The default max_batch_tokens_with_steps (docs/PERFORMANCE.md: the curve).
  static constexpr int64_t kTokensWithSteps = 128;
  // The cap on a call's Attend tokens while sessions step on the server
  // (WorkerPool::StepsRecently): a step waits at most for one such call
  // before its own. 0: max_batch_tokens (no cap).
  int64_t max_batch_tokens_with_steps = kTokensWithSteps;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int64_t max_queue_size = 1024;                 // requests waiting
  int64_t max_queue_bytes = int64_t{256} << 20;  // their tensor bytes
  // Triton's priority levels (1 is the highest; 0: none), and the level of
  // requests that name none, 0 or one above them. The queue is kept in level
  // order, oldest first within a level: a batch starts at the highest level
  // waiting.
  uint64_t priority_levels = 0;
  uint64_t default_priority_level = 0;
  // The server's engine workers (borrowed; they must outlive the batcher).
  // Null: the batcher makes a pool of its own with `workers` threads of
  // `compute_threads` each (tests, tools).
  WorkerPool* pool = nullptr;
  int workers = 1;          // threads calling the engine, own pool only
  int compute_threads = 0;  // threads per engine call, own pool only (0: the free cores)
  // The server's memory budget (borrowed; null: no accounting). Requests
  // reserve their queued bytes at Enqueue and their active bytes when a
  // batch takes them.
  MemoryBudget* memory = nullptr;
  // What queue delays and deadlines are measured with (borrowed; null: the
  // real clock). Tests pass a clock they move by hand.
  const Clock* clock = nullptr;
  // Where queueing and engine calls are counted (borrowed; may be null).
  ModelStatistics* statistics = nullptr;
};

// Owns one model version's queue of tasks (Attend requests, session steps,
// cross memories' projections) and forms its engine calls, which the
// server's worker pool runs (a PoolQueue of it). Borrows the engine, the
// pool, the metrics and the clock, which must outlive it. Every task enters
// through Enqueue (one admission path: queue limits, the memory budget,
// priority) and leaves answered exactly once; expired and cancelled tasks
// are refused before compute, whatever their kind. A call takes, in this
// order: projections (alone, before the call), then waiting steps (one per
// session, each started through its session's owner, which allocates its
// cache blocks), then Attend requests, capped while sessions step. Every
// method is thread-safe; Enqueue never blocks on compute; Stop waits for the
// pool to compute what is queued, so it must not run on a pool worker.
// In three files by job: batcher.cc (lanes, admission, forming a call),
// batcher_steps.cc (which waiting steps start, through StepTask's Begin,
// Allocate and Abandon) and engine_call.cc (running a call, scattering its
// results, recording it).
class Batcher final : public PoolQueue {
 public:
  Batcher(std::string model, const MhaEngine& engine, BatcherOptions options,
          ModelMetrics& metrics);
  ~Batcher() override;  // Stop(), then leaves the pool

  // Takes the task. It is answered exactly once: on a worker (computed,
  // dropped, or the engine failed), or at once, in this thread, with
  // RESOURCE_EXHAUSTED when the queue or the memory budget is full and
  // UNAVAILABLE when stopping.
  void Enqueue(std::unique_ptr<Task> task);

  // Stops taking tasks and returns once everything queued is computed.
  void Stop();
  // The steps it holds may start now, or be refused (their sessions' owner
  // is stopping): a worker looks at them.
  void WakeSteps();

  // The most threads one engine call uses (what requests are charged for).
  int MaxThreadsPerCall() const;

  // PoolQueue: the next work when it may run now (projections, then a
  // call).
  std::unique_ptr<PoolWork> Poll(Idle& idle) override;
  // PoolQueue: no request, projection or ready step queued.
  bool Empty() override;
  // PoolQueue: a call of the ready steps alone (chunks of split requests
  // among them), without the Attend requests that would join them in Poll.
  std::unique_ptr<PoolWork> PollSteps() override;
  // PoolQueue: steps wait that the last Poll left (beside projections, or
  // before a long request that carries none).
  bool StepsReady() override;

 private:
  // What a worker does next: projections, then a batch of Attend requests
  // and, when `steps`, the waiting session steps that may start. Counted in
  // flight from Poll until destroyed (Stop waits for it).
  struct Work final : PoolWork {
    explicit Work(Batcher& b) : batcher(b) {}
    ~Work() override;
    void Run(Workspace& ws) override;
    // Projections, or Attend requests of more query rows than the cap.
    bool MayYield() const override;
    Batcher& batcher;
    std::vector<std::unique_ptr<ProjectionTask>> projections;
    std::vector<std::unique_ptr<AttendCall>> batch;
    bool steps = false;
    bool in_yield = false;  // from PollSteps: inside another call's yield
    bool counted = false;   // in in_flight_ (set by Hand)
  };
  // A step the next call carries, started.
  struct StartedStep {
    std::unique_ptr<StepTask> task;
    StepPlan plan;
  };

  // Why the task cannot wait in the queue, or OK (then it is queued).
  absl::Status Admit(std::unique_ptr<Task>& task);
  // With mu_ held: puts an admitted task in its kind's lane.
  void Queue(std::unique_ptr<Task>& task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With mu_ held: counts `work` in flight and returns it for the pool.
  std::unique_ptr<PoolWork> Hand(std::unique_ptr<Work> work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The queue depth gauge: tasks of every kind waiting (mu_ held).
  void PublishDepth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether Stop may return: nothing queued or in flight (mu_ held).
  bool Drained() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why nobody wants `task` computed any more (cancelled, deadline passed,
  // counted), or OK. `stage`: what the task was doing ("queued" or
  // "computed").
  absl::Status Unwanted(Task& task, absl::Time now, const char* stage = "queued") const;
  // Whether every request of `live` was cancelled or passed its deadline
  // (its engine call then stops at its next yield point). Those before
  // `first_wanted` are known gone: a check costs one request while the
  // first stays wanted.
  bool NobodyWaits(const std::vector<std::unique_ptr<AttendCall>>& live,
                   size_t& first_wanted) const;
  // Takes the next batch of Attend requests once BatchReady (see Poll).
  std::vector<std::unique_ptr<AttendCall>> TakeBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes a batch early when `steps` ride along (they never wait).
  bool BatchReady(bool steps) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Query + key tokens queued that may join the oldest request's batch, up
  // to `limit`.
  int64_t TokensJoiningOldest(int64_t limit) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the oldest request goes in chunks (mu_ held): sessions step,
  // the cap is on, it has more query rows than the cap and is Splittable.
  bool SplitsOldest() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the oldest request runs whole although sessions step and the
  // cap is on (mu_ held): more query rows than the cap, not Splittable.
  bool RunsWholeBesideSteps() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A split request's chunks join the steps (no admission: the request was
  // admitted).
  void QueueChunks(std::vector<std::unique_ptr<StepTask>> chunks);
  // The Attend tokens of the next call: max_batch_tokens_, or the cap with
  // steps while sessions step on the server.
  int64_t TokenLimit() const;
  // Reserves the active bytes of a task the next call takes; without a
  // budget, always kGrown.
  MemoryBudget::Growth ReserveActive(Task& task);
  // The waiting steps that start now, oldest first, one per session, at
  // most max_batch_tokens_ tokens, of which chunks of long Attend requests
  // at most the cap with steps; those refused go to `refused` (their
  // `refusal` set). `more`: some were left for lack of room.
  std::vector<StartedStep> TakeSteps(std::vector<std::unique_ptr<Task>>& refused, bool& more);
  // Moves the waiting step at `it` to `refused` (its memory leaving);
  // `it` then points past it.
  void RefuseWaitingStep(std::deque<std::unique_ptr<StepTask>>::iterator& it,
                         std::vector<std::unique_ptr<Task>>& refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts one waiting step (mu_ held): kTaken (its memory reserved, its
  // blocks allocated, `plan` set), kBusy (its session computes another
  // step), kNoRoom (its memory may fit once this call is done), or kRefused
  // (its `refusal` set; the caller moves it out).
  enum class StepTaken { kTaken, kBusy, kNoRoom, kRefused };
  StepTaken TryStartStep(std::unique_ptr<StepTask>& step, bool call_empty, StepPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The memory and the blocks of a step Begin started (mu_ held): OK, or
  // `no_room` (it may fit once this call is done), or why it is refused.
  absl::Status AdmitStartedStep(StepTask& step, bool call_empty, bool& no_room)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunProjections(std::vector<std::unique_ptr<ProjectionTask>> projections, Workspace& ws);
  void Compute(std::vector<std::unique_ptr<AttendCall>> batch, bool steps, Workspace& ws);
  // Computes the requests and the steps in one engine call (Compute passes
  // one kind at a time: the steps' call goes first), encodes the requests'
  // answers, records the call's statistics (RecordCall), then answers the
  // steps and the requests; `answered` counts the steps and requests
  // answered, so that on an allocation failure Compute answers only the
  // rest (those counted OK already are not counted again).
  void ComputeLive(const std::vector<std::unique_ptr<AttendCall>>& live,
                   std::vector<StartedStep>& steps, Workspace& ws, size_t& answered);
  // Records one engine call's statistics (ModelStatistics::Record): the
  // requests whose `answers` are OK and the counted steps, with the call's
  // stages (merging inputs from `merging`, the engine call from `start` to
  // `computed`, encoding the answers since).
  void RecordCall(const std::vector<std::unique_ptr<AttendCall>>& live,
                  const std::vector<absl::Status>& answers, const std::vector<StartedStep>& steps,
                  absl::Time merging, absl::Time start, absl::Time computed);
  // After a call that ran steps or projections: steps left waiting may
  // start now (their sessions are free again): wake a worker.
  void WakeLeftSteps(bool ran_some, bool more);
  // Adds the primitives the engine created since the last report (on any
  // worker) to the metric.
  void ReportPrimitiveCacheMisses();

  const std::string model_;
  const MhaEngine& engine_;
  const BatcherOptions options_;
  ModelMetrics& metrics_;
  const Clock& clock_;
  std::unique_ptr<WorkerPool> own_pool_;  // when options_.pool is null
  WorkerPool& pool_;
  const int64_t max_batch_tokens_;   // options_' value, 0 resolved
  const int64_t tokens_with_steps_;  // options_' max_batch_tokens_with_steps, resolved
  WorkerPool::Registration* registration_ = nullptr;

  Mutex mu_;
  CondVar drained_cv_;                      // Stop waits on it
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // works handed out
  // The lanes, each oldest first (Attend requests in priority level order).
  std::deque<std::unique_ptr<AttendCall>> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<StepTask>> steps_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<ProjectionTask>> projections_ ABSL_GUARDED_BY(mu_);
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;  // Attend's
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Steps may start: a worker takes them into its next call.
  bool steps_ready_ ABSL_GUARDED_BY(mu_) = false;
  // The long request ready steps last went before (see Poll); compared,
  // never dereferenced.
  const AttendCall* passed_over_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::atomic<uint64_t> reported_misses_;  // engine's count already in the metric
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_BATCHER_H_
