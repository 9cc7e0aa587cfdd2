// Admission and the lanes: where a model version's tasks wait, and the one
// path by which they get there.
#ifndef MHA_SERVER_SCHEDULING_TASK_LANES_H_
#define MHA_SERVER_SCHEDULING_TASK_LANES_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/observability/metrics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/batcher_options.h"
#include "server/scheduling/task.h"

namespace mha::server {

// Owns one model version's waiting tasks in three lanes, each oldest first:
// encoder memories' projections, session steps (with the chunks of split
// requests), and Attend requests in priority level order. Admits every task
// (the queue's count and byte limits, the memory budget, the priority level)
// and keeps the counts the limits, the call former and the depth gauge
// read. Borrows the options' memory budget and the metrics. Not
// thread-safe: its batcher holds it under its lock (Batcher::mu_).
class TaskLanes {
 public:
  using Requests = std::deque<std::unique_ptr<AttendCall>>;
  using Steps = std::deque<std::unique_ptr<StepTask>>;

  TaskLanes(std::string model, const BatcherOptions& options, ModelMetrics& metrics);

  // Queues `task` at `now` and returns OK, or returns why it cannot wait
  // (RESOURCE_EXHAUSTED: the queue's count or bytes, or the memory budget)
  // and leaves it with the caller, counted as dropped. If it throws
  // (std::bad_alloc), nothing changed and the task is the caller's.
  absl::Status Admit(std::unique_ptr<Task>& task, absl::Time now);
  // A split request's chunks join the steps (admitted with their request).
  void AddChunks(std::vector<std::unique_ptr<StepTask>>& chunks, absl::Time now);

  const Requests& requests() const { return requests_; }
  const Steps& steps() const { return steps_; }
  bool has_projections() const { return !projections_.empty(); }
  // Query + key tokens of the Attend requests waiting.
  int64_t queued_tokens() const { return queued_tokens_; }
  // Tasks of every kind waiting.
  size_t size() const { return requests_.size() + steps_.size() + projections_.size(); }
  bool empty() const { return size() == 0; }

  // Every projection, leaving (their memory comes back as they finish).
  std::vector<std::unique_ptr<ProjectionTask>> TakeProjections();
  // The request at `index` leaves its lane (and the counts); those behind
  // it move up one.
  std::unique_ptr<AttendCall> TakeRequest(size_t index);
  // The oldest request leaves its lane into what `split` makes of it (a
  // SplitAttendCall, which takes it only once nothing can throw). If
  // `split` throws, the request stays first and nothing changed.
  std::unique_ptr<ProjectionTask> SplitOldest(
      absl::FunctionRef<std::unique_ptr<ProjectionTask>(std::unique_ptr<AttendCall>&)> split);
  // The same for a step. `refused`: no call computes it (its memory is
  // marked leaving; the caller answers it).
  std::unique_ptr<StepTask> TakeStep(size_t index, bool refused);

  // Whether a worker should look at the steps (one was queued, or steps
  // left waiting may start now). Cleared by the worker that takes them.
  bool steps_ready() const { return steps_ready_; }
  // Sets steps_ready when steps wait; returns whether any do.
  bool MarkStepsReady();
  // steps_ready, cleared.
  bool TakeStepsReady();

 private:
  absl::Status CheckRoom(Task& task) const;
  // Puts an admitted task in its kind's lane.
  void Queue(std::unique_ptr<Task>& task);
  // The queue depth gauge: tasks of every kind waiting.
  void PublishDepth() const;

  const std::string model_;
  const BatcherOptions& options_;
  ModelMetrics& metrics_;
  Requests requests_;
  Steps steps_;
  std::deque<std::unique_ptr<ProjectionTask>> projections_;
  int64_t queued_tokens_ = 0;  // Attend's
  int64_t queued_bytes_ = 0;   // every kind's, as received
  bool steps_ready_ = false;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_TASK_LANES_H_
