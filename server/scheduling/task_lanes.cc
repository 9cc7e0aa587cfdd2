#include "server/scheduling/task_lanes.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/scheduling/admission.h"

namespace mha::server {

TaskLanes::TaskLanes(std::string model, const BatcherOptions& options, ModelMetrics& metrics)
    : model_(std::move(model)), options_(options), metrics_(metrics) {}

absl::Status TaskLanes::Admit(std::unique_ptr<Task>& task, absl::Time now) {
  if (absl::Status room = CheckRoom(*task); !room.ok()) return room;
  task->enqueued = now;
  Queue(task);  // if it throws, nothing has changed
  PublishDepth();
  return absl::OkStatus();
}

absl::Status TaskLanes::CheckRoom(Task& task) const {
  if (static_cast<int64_t>(size()) >= options_.max_queue_size) {
    task.CountDropped(metrics_, "queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", options_.max_queue_size, " requests waiting)"));
  }
  if (queued_bytes_ + task.wire_bytes > options_.max_queue_bytes) {
    task.CountDropped(metrics_, "queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", queued_bytes_, " bytes waiting, this ", NounOf(task),
        " ", task.wire_bytes, ", limit ", options_.max_queue_bytes, ")"));
  }
  MemoryBudget* memory = options_.memory;
  if (memory == nullptr) return absl::OkStatus();
  // Its working memory (a step's as of its session's position now) against
  // the whole budget, then against what is free.
  if (absl::Status fits = CheckFitsBudget(task, memory->capacity()); !fits.ok()) {
    task.CountDropped(metrics_, "memory");
    return fits;
  }
  if (!memory->TryReserveQueued(task.queued_bytes, *task.memory)) {
    task.CountDropped(metrics_, "memory");
    return MemoryBudgetFull(memory->reserved(), memory->capacity(), NounOf(task), task.queued_bytes,
                            "to wait in the queue");
  }
  return absl::OkStatus();
}

void TaskLanes::Queue(std::unique_ptr<Task>& task) {
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
      auto behind = requests_.end();
      while (behind != requests_.begin() && (*std::prev(behind))->priority > level) --behind;
      auto slot = requests_.emplace(behind);
      slot->reset(static_cast<AttendCall*>(task.release()));
      (*slot)->priority = level;
      queued_tokens_ += (*slot)->input().tokens();
      break;
    }
  }
  queued_bytes_ += bytes;
}

void TaskLanes::AddChunks(std::vector<std::unique_ptr<StepTask>>& chunks, absl::Time now) {
  for (auto& chunk : chunks) {
    chunk->enqueued = now;
    queued_bytes_ += chunk->wire_bytes;
    steps_.push_back(std::move(chunk));
  }
  steps_ready_ = true;
  PublishDepth();
}

std::vector<std::unique_ptr<ProjectionTask>> TaskLanes::TakeProjections() {
  std::vector<std::unique_ptr<ProjectionTask>> taken;
  taken.reserve(projections_.size());  // may throw: then nothing changed
  for (auto& p : projections_) {
    queued_bytes_ -= p->wire_bytes;
    // Their bytes come back by themselves once they ran.
    if (options_.memory != nullptr) options_.memory->MarkLeaving(*p->memory);
    taken.push_back(std::move(p));
  }
  projections_.clear();
  PublishDepth();
  return taken;
}

std::unique_ptr<AttendCall> TaskLanes::TakeRequest(size_t index) {
  const auto it = requests_.begin() + static_cast<std::ptrdiff_t>(index);
  std::unique_ptr<AttendCall> request = std::move(*it);
  requests_.erase(it);
  queued_tokens_ -= request->input().tokens();
  queued_bytes_ -= request->wire_bytes;
  PublishDepth();
  return request;
}

std::unique_ptr<ProjectionTask> TaskLanes::SplitOldest(
    absl::FunctionRef<std::unique_ptr<ProjectionTask>(std::unique_ptr<AttendCall>&)> split) {
  const AttendCall& oldest = *requests_.front();  // lives on in the split
  const int64_t tokens = oldest.input().tokens(), bytes = oldest.wire_bytes;
  std::unique_ptr<ProjectionTask> task = split(requests_.front());
  requests_.pop_front();
  queued_tokens_ -= tokens;
  queued_bytes_ -= bytes;
  PublishDepth();
  return task;
}

std::unique_ptr<StepTask> TaskLanes::TakeStep(size_t index, bool refused) {
  const auto it = steps_.begin() + static_cast<std::ptrdiff_t>(index);
  std::unique_ptr<StepTask> step = std::move(*it);
  steps_.erase(it);
  queued_bytes_ -= step->wire_bytes;
  if (refused && options_.memory != nullptr) options_.memory->MarkLeaving(*step->memory);
  PublishDepth();
  return step;
}

bool TaskLanes::MarkStepsReady() {
  if (steps_.empty()) return false;
  steps_ready_ = true;
  return true;
}

bool TaskLanes::TakeStepsReady() {
  const bool ready = steps_ready_;
  steps_ready_ = false;
  return ready;
}

void TaskLanes::PublishDepth() const { metrics_.queue_depth->Set(static_cast<double>(size())); }

}  // namespace mha::server
