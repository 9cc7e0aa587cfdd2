#include "server/scheduling/step_starter.h"

#include <algorithm>
#include <utility>

#include "server/scheduling/admission.h"

namespace mha::server {

StepStarter::StepStarter(const BatcherOptions& options, CallTokens tokens,
                         const ModelMetrics& metrics)
    : options_(options), tokens_(tokens), metrics_(metrics) {}

std::vector<StartedStep> StepStarter::TakeSteps(TaskLanes& lanes, const Mutex& /*lanes_lock*/,
                                                absl::Time now,
                                                std::vector<std::unique_ptr<Task>>& refused,
                                                bool& more) const {
  // Room made first: once a step has started, nothing here allocates.
  const size_t waiting = lanes.steps().size();
  std::vector<StartedStep> started;
  std::vector<const void*> blocked;  // sessions whose later steps wait
  started.reserve(waiting);
  blocked.reserve(waiting);
  refused.reserve(refused.size() + waiting);
  auto is_blocked = [&](const void* session) {
    return std::find(blocked.begin(), blocked.end(), session) != blocked.end();
  };
  int64_t tokens = 0, attend_rows = 0;
  for (size_t i = 0; i < lanes.steps().size();) {
    StepTask& step = *lanes.steps()[i];
    if (is_blocked(step.session())) {
      ++i;
      continue;
    }
    if (absl::Status unwanted = Unwanted(step, now, metrics_); !unwanted.ok()) {
      step.refusal = std::move(unwanted);
      refused.push_back(lanes.TakeStep(i, /*refused=*/true));
      continue;
    }
    // One step per session and call; a step that stays keeps its
    // session's later steps behind it. Chunks of long Attend requests
    // share the call's Attend cap: at most one chunk's rows beside the
    // steps.
    const bool over_cap =
        step.attend_rows() && attend_rows > 0 && attend_rows + step.tokens() > tokens_.with_steps;
    if ((!started.empty() && tokens + step.tokens() > tokens_.max) || over_cap) {
      more = true;
      blocked.push_back(step.session());
      ++i;
      continue;
    }
    StepPlan plan;
    const StepTaken taken = TryStartStep(step, started.empty(), plan);
    if (taken == StepTaken::kRefused) {
      refused.push_back(lanes.TakeStep(i, /*refused=*/true));
      continue;
    }
    blocked.push_back(step.session());
    if (taken != StepTaken::kTaken) {
      more |= taken == StepTaken::kNoRoom;
      ++i;
      continue;
    }
    tokens += step.tokens();
    if (step.attend_rows()) attend_rows += step.tokens();
    step.waited = now - step.enqueued;
    started.push_back({lanes.TakeStep(i, /*refused=*/false), plan});
  }
  return started;
}

StepStarter::StepTaken StepStarter::TryStartStep(StepTask& step, bool call_empty,
                                                 StepPlan& plan) const {
  absl::Status why;
  switch (step.Begin(plan, why)) {
    case StepTask::Start::kBusy:
      return StepTaken::kBusy;
    case StepTask::Start::kRefused:
      step.refusal = std::move(why);
      return StepTaken::kRefused;
    case StepTask::Start::kRun:
      break;
  }
  // Started: a refusal from here gives the session back first, under the
  // batcher's lock, so that its next step may start in this call or the
  // next.
  absl::Status refusal;
  bool no_room = false;
  try {
    refusal = AdmitStartedStep(step, call_empty, no_room);
  } catch (...) {
    step.Abandon();
    throw;
  }
  if (refusal.ok() && !no_room) return StepTaken::kTaken;
  step.Abandon();
  if (no_room) return StepTaken::kNoRoom;
  step.refusal = std::move(refusal);
  return StepTaken::kRefused;
}

absl::Status StepStarter::AdmitStartedStep(StepTask& step, bool call_empty, bool& no_room) const {
  MemoryBudget* memory = options_.memory;
  if (memory != nullptr) {
    const RequestCost cost{.queued_bytes = step.queued_bytes, .active_bytes = step.active_bytes};
    absl::Status fits = CheckStepMemory(cost, memory->capacity());
    if (fits.ok() && ReserveActive(memory, step) != MemoryBudget::Growth::kGrown) {
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

}  // namespace mha::server
