// Admission by bytes: what a decoded request will cost, known from its
// shapes before it takes any memory or time, and the checks made on it
// before it is queued.
#ifndef MHA_SERVER_SCHEDULING_ADMISSION_H_
#define MHA_SERVER_SCHEDULING_ADMISSION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/attention_request.h"
#include "engine/mha_engine.h"
#include "server/observability/metrics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/memory_budget.h"
#include "server/scheduling/task.h"

namespace mha::server {

// The bytes one request costs the server, by the time they are held.
struct RequestCost {
  int64_t response_bytes = 0;  // the response message on the wire (tensor data + framing)
  int64_t queued_bytes = 0;    // while it waits: the request as received, and decoded
  int64_t active_bytes = 0;    // computing and answering: engine scratch, merged copies,
                               // f32 results, the response and its serialized form
  int64_t total() const { return queued_bytes + active_bytes; }
};

// From the decoded request's shapes alone; `threads` is what one engine
// call of the model uses.
RequestCost CostOf(const AttentionRequest& request, const MhaEngine& engine, int threads);
// The same for a session step: `query` is the step's decoded query, `keys`
// what it attends to (its session's position after it plus the model's
// extra keys). Its queued bytes are known when it arrives; its active bytes
// once its session's position is, when the scheduler takes it.
RequestCost CostOfStep(const AttentionRequest& query, int64_t keys, const MhaEngine& engine,
                       int threads);

// RESOURCE_EXHAUSTED when the response could never be sent: above
// `max_message_bytes`. The message names the numbers and what to change.
absl::Status CheckResponseSize(const AttentionRequest& request, const RequestCost& cost,
                               int64_t max_message_bytes);
// RESOURCE_EXHAUSTED when the request alone needs more than the memory
// budget gives all requests in flight (`memory_capacity`).
absl::Status CheckWorkingMemory(const AttentionRequest& request, const RequestCost& cost,
                                int64_t memory_capacity);
// The same for a session step.
absl::Status CheckStepMemory(const RequestCost& cost, int64_t memory_capacity);

// RESOURCE_EXHAUSTED when `task` alone needs more than the memory budget
// gives all work in flight (`memory_capacity`), whatever its kind: an Attend
// request (CheckWorkingMemory), a session step (CheckStepMemory) or an
// encoder memory's projection. The one check TaskLanes::Admit makes.
absl::Status CheckFitsBudget(const Task& task, int64_t memory_capacity);

// The one refusal of work the memory budget has no room for now (it fits the
// budget alone, but not beside what is held): RESOURCE_EXHAUSTED naming what
// is held (`reserved` of `capacity` bytes), what this `work` ("request",
// "step") needs, and what for ("to wait in the queue", "more to compute").
absl::Status MemoryBudgetFull(int64_t reserved, int64_t capacity, const char* work, int64_t bytes,
                              const char* purpose);

// Reserves the active bytes of `task` as a call takes it (its queued bytes
// are held already); without a budget (null), always kGrown.
MemoryBudget::Growth ReserveActive(MemoryBudget* budget, Task& task);

// What `task` is called in refusals: "request", "step" or "encoder memory".
const char* NounOf(const Task& task);

// Why nobody wants `task` computed any more, or OK: DEADLINE_EXCEEDED (its
// deadline passed by `now`, or it was cancelled just before it) or
// CANCELLED, counted as dropped in `metrics`. `stage`: what the task was
// doing ("queued" or "computed").
absl::Status Unwanted(Task& task, absl::Time now, const ModelMetrics& metrics,
                      const char* stage = "queued");

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_ADMISSION_H_
