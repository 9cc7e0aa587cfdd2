// The dynamic ragged batcher: merges concurrent requests of one model into
// one engine call, back to back, never padded.
#ifndef MHA_SERVER_SCHEDULING_BATCHER_H_
#define MHA_SERVER_SCHEDULING_BATCHER_H_

#include <memory>
#include <string>
#include <vector>

#include "engine/mutex.h"
#include "server/observability/metrics.h"
#include "server/scheduling/batcher_options.h"
#include "server/scheduling/call_former.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/engine_call.h"
#include "server/scheduling/step_starter.h"
#include "server/scheduling/task.h"
#include "server/scheduling/task_lanes.h"
#include "server/scheduling/worker_pool.h"

namespace mha {
class MhaEngine;
class Workspace;
}  // namespace mha

namespace mha::server {

// Owns one model version's scheduler and composes its parts: the lanes
// (TaskLanes: admission, the three lanes, priority), the call former
// (CallFormer: what the next engine call takes), the step starter
// (StepStarter: which waiting steps start, through their sessions' owner)
// and the call runner (EngineCallRunner: computing, answering, recording).
// The server's worker pool runs its calls (a PoolQueue of it). Borrows the
// engine, the pool, the metrics and the clock, which must outlive it. Every
// task enters through Enqueue and leaves answered exactly once; expired
// and cancelled tasks are refused before compute, whatever their kind. A
// worker's turn takes, in this order: projections (alone, before the call),
// then waiting steps (one per session, each started through its session's
// owner, which allocates its cache blocks), then Attend requests, capped
// while sessions step. Every method is thread-safe; Enqueue never blocks on
// compute; Stop waits for the pool to compute what is queued, so it must
// not run on a pool worker.
class Batcher final : public PoolQueue {
 public:
  Batcher(std::string model, const MhaEngine& engine, BatcherOptions options,
          ModelMetrics& metrics);
  ~Batcher() override;  // Stop(), then leaves the pool

  // Takes the task. It is answered exactly once: on a worker (computed,
  // dropped, or the engine failed), or at once, in this thread, with
  // RESOURCE_EXHAUSTED when the queue or the memory budget is full and
  // UNAVAILABLE when stopped.
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
  // What a worker does next (a CallPlan). Counted in flight from Poll until
  // destroyed (Stop waits for it).
  struct Work final : PoolWork {
    explicit Work(Batcher& b) : batcher(b) {}
    ~Work() override;
    void Run(Workspace& ws) override { batcher.RunCall(call, in_yield, ws); }
    // Projections, or Attend requests of more query rows than the cap.
    bool MayYield() const override;
    Batcher& batcher;
    CallPlan call;
    bool in_yield = false;  // from PollSteps: inside another call's yield
    bool counted = false;   // in in_flight_ (set by Hand)
  };

  // With mu_ held: counts `work` in flight and returns it for the pool.
  std::unique_ptr<PoolWork> Hand(std::unique_ptr<Work> work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A split request's chunks join the steps (no admission: the request was
  // admitted).
  void QueueChunks(std::vector<std::unique_ptr<StepTask>> chunks);
  // On a worker: runs `call`'s projections, then its steps (started here,
  // under mu_) and its requests.
  void RunCall(CallPlan& call, bool in_yield, Workspace& ws);
  // After a call that ran steps or projections: steps left waiting may
  // start now (their sessions are free again): wake a worker.
  void WakeLeftSteps(bool ran_some, bool more);

  const BatcherOptions options_;
  ModelMetrics& metrics_;
  const Clock& clock_;
  std::unique_ptr<WorkerPool> own_pool_;  // when options_.pool is null
  WorkerPool& pool_;
  const CallTokens tokens_;
  WorkerPool::Registration* registration_ = nullptr;
  EngineCallRunner runner_;
  const StepStarter starter_;

  Mutex mu_;
  CondVar drained_cv_;                      // Stop waits on it
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // works handed out
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  TaskLanes lanes_ ABSL_GUARDED_BY(mu_);
  CallFormer former_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_BATCHER_H_
