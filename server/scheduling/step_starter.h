// Starting the session steps an engine call takes.
#ifndef MHA_SERVER_SCHEDULING_STEP_STARTER_H_
#define MHA_SERVER_SCHEDULING_STEP_STARTER_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/mutex.h"
#include "server/observability/metrics.h"
#include "server/scheduling/batcher_options.h"
#include "server/scheduling/task.h"
#include "server/scheduling/task_lanes.h"

namespace mha::server {

// A step the next call carries, started.
struct StartedStep {
  std::unique_ptr<StepTask> task;
  StepPlan plan;
};

// Starts the waiting session steps of the next engine call: oldest first,
// one per session, within the call's tokens (chunks of split requests within
// the cap on Attend tokens) and the memory budget, asking each step's
// session owner through StepTask's Begin, Allocate and Abandon. Borrows the
// options (with their memory budget) and the metrics; holds no task. Not
// thread-safe: its batcher calls it under its lock (Batcher::mu_), with the
// lanes.
//
// Lock order, where both are taken: the batcher's lock is held here, and
// Begin, Allocate and Abandon take the session owner's (SessionManager::mu_)
// inside it; an owner never calls into a batcher while it holds its own.
// TakeSteps requires the batcher's lock (checked by clang), and the TSan
// stage's session tests run both orders' code paths, where ThreadSanitizer
// reports any inversion.
class StepStarter {
 public:
  StepStarter(const BatcherOptions& options, CallTokens tokens, const ModelMetrics& metrics);

  // The waiting steps that start now, out of `lanes`; those refused (their
  // deadline passed, cancelled, their session refuses, or the memory budget
  // cannot hold them) go to `refused`, their `refusal` set, for the caller
  // to answer outside the lock. `more`: some were left for lack of room.
  // `lanes_lock`: the batcher's lock, held.
  std::vector<StartedStep> TakeSteps(TaskLanes& lanes, const Mutex& lanes_lock, absl::Time now,
                                     std::vector<std::unique_ptr<Task>>& refused, bool& more) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lanes_lock);

 private:
  // What became of one waiting step asked to start: kTaken (its memory
  // reserved, its blocks allocated, `plan` set), kBusy (its session
  // computes another step), kNoRoom (its memory may fit once this call is
  // done), or kRefused (its `refusal` set).
  enum class StepTaken { kTaken, kBusy, kNoRoom, kRefused };
  StepTaken TryStartStep(StepTask& step, bool call_empty, StepPlan& plan) const;
  // The memory and the blocks of a step Begin started: OK, or `no_room`
  // (it may fit once this call is done), or why it is refused.
  absl::Status AdmitStartedStep(StepTask& step, bool call_empty, bool& no_room) const;

  const BatcherOptions& options_;
  const CallTokens tokens_;
  const ModelMetrics& metrics_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_STEP_STARTER_H_
