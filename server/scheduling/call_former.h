// Forming a model version's next engine call from its lanes.
#ifndef MHA_SERVER_SCHEDULING_CALL_FORMER_H_
#define MHA_SERVER_SCHEDULING_CALL_FORMER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/mha_engine.h"
#include "server/observability/metrics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/batcher_options.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/split_attend.h"
#include "server/scheduling/task.h"
#include "server/scheduling/task_lanes.h"
#include "server/scheduling/worker_pool.h"

namespace mha::server {

// What one worker's turn takes from the lanes.
struct CallPlan {
  // Run first, each alone (encoder memories, a split request's keys).
  std::vector<std::unique_ptr<ProjectionTask>> projections;
  // Attend requests of one signature, computed in one engine call.
  std::vector<std::unique_ptr<AttendCall>> batch;
  // The waiting steps that may start join (StepStarter), in a call of their
  // own before the batch.
  bool steps = false;
};

// Decides the next engine call of a model version: projections first, alone;
// then whether a batch of Attend requests may close (full, its oldest waited
// the queue delay, batching off, stopping, or steps go now); which requests
// join the oldest (its signature, the token limit, the memory budget); and,
// while sessions step, whether the oldest goes in chunks beside them or
// whole after them. Borrows the engine, the options (with their memory
// budget), the metrics and the clock. Holds only which long request ready
// steps last went before. Not thread-safe: its batcher calls it under its
// lock (Batcher::mu_), with the lanes.
class CallFormer {
 public:
  // `sessions_step`: whether sessions step on the server now (the pool's
  // StepsRecently); `queue_chunks`: where a split request's chunks go.
  CallFormer(const MhaEngine& engine, const BatcherOptions& options, CallTokens tokens,
             const ModelMetrics& metrics, const Clock& clock, std::function<bool()> sessions_step,
             QueueChunks queue_chunks);

  // Moves the next call's tasks from `lanes` into `call` and returns true,
  // or returns false and says in `idle` when to ask again. `stopping`:
  // what is queued goes now.
  bool Form(TaskLanes& lanes, bool stopping, CallPlan& call, PoolQueue::Idle& idle);

  // The Attend tokens of the next call: the cap while sessions step.
  int64_t TokenLimit() const;
  // Whether a batch may close now; `steps`: steps ride along (they never
  // wait). Requests that cannot join the oldest one's batch (another
  // signature) do not fill it.
  bool BatchReady(const TaskLanes& lanes, bool steps, bool stopping) const;
  // Whether the oldest request goes in chunks: sessions step, the cap is
  // on, it has more query rows than the cap and is Splittable.
  bool SplitsOldest(const TaskLanes& lanes) const;
  // Whether the oldest request runs whole although sessions step and the
  // cap is on: more query rows than the cap, and not Splittable.
  bool RunsWholeBesideSteps(const TaskLanes& lanes) const;

 private:
  // Query + key tokens queued that may join the oldest request's batch, up
  // to `limit`.
  int64_t TokensJoiningOldest(const TaskLanes& lanes, int64_t limit) const;
  // With the oldest request's active memory reserved: it and the requests
  // that join it, in queue order.
  std::vector<std::unique_ptr<AttendCall>> TakeBatch(TaskLanes& lanes) const;
  // With the oldest request's active memory reserved: when it goes in
  // chunks, the task that projects its keys and values, in `call`.
  bool TakeSplit(TaskLanes& lanes, CallPlan& call) const;
  // The oldest request, whose memory is not there (`growth`): false while
  // memory held by calls will come back, else it leaves alone, refused
  // (or unwanted), for the engine call to answer.
  bool TakeRefused(TaskLanes& lanes, MemoryBudget::Growth growth, CallPlan& call,
                   PoolQueue::Idle& idle) const;

  const MhaEngine& engine_;
  const BatcherOptions& options_;
  const CallTokens tokens_;
  const ModelMetrics& metrics_;
  const Clock& clock_;
  const std::function<bool()> sessions_step_;
  const QueueChunks queue_chunks_;
  // The long request ready steps last went before (see Form); compared,
  // never dereferenced.
  const AttendCall* passed_over_ = nullptr;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_CALL_FORMER_H_
