// Batcher's session steps: which waiting steps start in the next engine
// call (one per session, within the call's tokens and the memory budget),
// asking the sessions through StepTask's narrow interface (Begin, Allocate,
// Abandon), and waking a worker for steps left waiting. Runs under the
// batcher's lock (Batcher::mu_), which is taken before a session manager's:
// Begin, Allocate and Abandon take SessionManager::mu_ inside it.
#include <algorithm>
#include <utility>

#include "server/scheduling/admission.h"
#include "server/scheduling/batcher.h"

namespace mha::server {

Batcher::StepTaken Batcher::TryStartStep(std::unique_ptr<StepTask>& step, bool call_empty,
                                         StepPlan& plan) {
  absl::Status why;
  switch (step->Begin(plan, why)) {
    case StepTask::Start::kBusy:
      return StepTaken::kBusy;
    case StepTask::Start::kRefused:
      step->refusal = std::move(why);
      return StepTaken::kRefused;
    case StepTask::Start::kRun:
      break;
  }
  // Started: a refusal from here gives the session back first, under this
  // lock, so that its next step may start in this call or the next.
  absl::Status refusal;
  bool no_room = false;
  try {
    refusal = AdmitStartedStep(*step, call_empty, no_room);
  } catch (...) {
    step->Abandon();
    throw;
  }
  if (refusal.ok() && !no_room) return StepTaken::kTaken;
  step->Abandon();
  if (no_room) return StepTaken::kNoRoom;
  step->refusal = std::move(refusal);
  return StepTaken::kRefused;
}

absl::Status Batcher::AdmitStartedStep(StepTask& step, bool call_empty, bool& no_room) {
  MemoryBudget* memory = options_.memory;
  if (memory != nullptr) {
    const RequestCost cost{.queued_bytes = step.queued_bytes, .active_bytes = step.active_bytes};
    absl::Status fits = CheckStepMemory(cost, memory->capacity());
    if (fits.ok() && ReserveActive(step) != MemoryBudget::Growth::kGrown) {
      // It may fit once the steps of this call are done.
      if (!call_empty) {
        no_room = true;
        return absl::OkStatus();
      }
      // A step does not wait for memory behind Attend requests.
      fits = MemoryBudgetFull(memory->reserved(), memory->capacity(), "step", step.active_bytes,
                              "more to compute");
    }
    if (!fits.ok()) {
      step.CountDropped(metrics_, "memory");
      return fits;
    }
  }
  return step.Allocate();
}

std::vector<Batcher::StartedStep> Batcher::TakeSteps(std::vector<std::unique_ptr<Task>>& refused,
                                                     bool& more) {
  MutexLock lock(mu_);
  const absl::Time now = clock_.Now();
  // Room made first: once a step has started, nothing here allocates.
  std::vector<StartedStep> started;
  std::vector<const void*> blocked;  // sessions whose later steps wait
  started.reserve(steps_.size());
  blocked.reserve(steps_.size());
  refused.reserve(refused.size() + steps_.size());
  auto is_blocked = [&](const void* session) {
    return std::find(blocked.begin(), blocked.end(), session) != blocked.end();
  };
  int64_t tokens = 0, attend_rows = 0;
  for (auto it = steps_.begin(); it != steps_.end();) {
    StepTask& step = **it;
    if (is_blocked(step.session())) {
      ++it;
      continue;
    }
    if (absl::Status unwanted = Unwanted(step, now); !unwanted.ok()) {
      step.refusal = std::move(unwanted);
      RefuseWaitingStep(it, refused);
      continue;
    }
    // One step per session and call; a step that stays keeps its
    // session's later steps behind it.
    // Chunks of long Attend requests share the call's Attend cap: at most
    // one chunk's rows beside the steps.
    const bool over_cap =
        step.attend_rows() && attend_rows > 0 && attend_rows + step.tokens() > tokens_with_steps_;
    if ((!started.empty() && tokens + step.tokens() > max_batch_tokens_) || over_cap) {
      more = true;
      blocked.push_back(step.session());
      ++it;
      continue;
    }
    StepPlan plan;
    switch (TryStartStep(*it, started.empty(), plan)) {
      case StepTaken::kBusy:
        blocked.push_back(step.session());
        ++it;
        continue;
      case StepTaken::kNoRoom:
        more = true;
        blocked.push_back(step.session());
        ++it;
        continue;
      case StepTaken::kRefused:
        RefuseWaitingStep(it, refused);
        continue;
      case StepTaken::kTaken:
        blocked.push_back(step.session());
        break;
    }
    tokens += step.tokens();
    if (step.attend_rows()) attend_rows += step.tokens();
    queued_bytes_ -= step.wire_bytes;
    step.waited = now - step.enqueued;
    started.push_back({std::move(*it), plan});
    it = steps_.erase(it);
  }
  PublishDepth();
  return started;
}

void Batcher::RefuseWaitingStep(std::deque<std::unique_ptr<StepTask>>::iterator& it,
                                std::vector<std::unique_ptr<Task>>& refused) {
  StepTask& step = **it;
  if (options_.memory != nullptr) options_.memory->MarkLeaving(*step.memory);
  queued_bytes_ -= step.wire_bytes;
  refused.push_back(std::move(*it));
  it = steps_.erase(it);
}

void Batcher::WakeSteps() { WakeLeftSteps(/*ran_some=*/true, /*more=*/false); }

void Batcher::WakeLeftSteps(bool ran_some, bool more) {
  if (!ran_some && !more) return;
  {
    MutexLock lock(mu_);
    if (steps_.empty()) return;
    steps_ready_ = true;
  }
  pool_.Wake(registration_, /*steps=*/true);
}

}  // namespace mha::server
