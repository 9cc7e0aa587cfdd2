#include "server/scheduling/admission.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/ragged_batch.h"
#include "engine/too_large.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {
namespace {

// Protobuf framing of a response beyond its tensor bytes (tags, lengths,
// shapes, names): generously bounded.
constexpr int64_t kResponseFraming = 4096;

}  // namespace

RequestCost CostOf(const AttentionRequest& request, const MhaEngine& engine, int threads) {
  const int64_t results_f32 = (request.output_elements() + request.weights_elements()) * 4;
  RequestCost cost;
  cost.response_bytes =
      request.output_elements() * static_cast<int64_t>(DTypeSize(request.output_dtype())) +
      request.weights_elements() * 4 + kResponseFraming;
  cost.queued_bytes = request.wire_bytes() + request.converted_bytes();
  // A batch of several requests (or carrying session steps) copies their
  // inputs into one (counted always, since the batch a request lands in is
  // not known yet) and writes each one's f32 results, which are encoded
  // into the response.
  cost.active_bytes = engine.ScratchBytes(request.shape(), threads) +
                      RaggedBatch::MergedBytes(request) + results_f32 + 2 * cost.response_bytes;
  return cost;
}

RequestCost CostOfStep(const AttentionRequest& query, int64_t keys, const MhaEngine& engine,
                       int threads) {
  const int64_t tokens = query.q_len(), e = engine.dims().embed_dim;
  const int64_t weights = query.need_weights() ? tokens * keys : 0;
  RequestCost cost;
  cost.response_bytes = tokens * e * static_cast<int64_t>(DTypeSize(query.output_dtype())) +
                        weights * 4 + kResponseFraming;
  cost.queued_bytes = query.wire_bytes() + query.converted_bytes();
  // The step group's copy of the query, its copy beside Attend rows in a
  // mixed call, the f32 output and weights, the response twice.
  cost.active_bytes = engine.StepScratchBytes(tokens, keys, query.need_weights(), threads) +
                      3 * tokens * e * 4 + weights * 4 + 2 * cost.response_bytes;
  return cost;
}

absl::Status CheckResponseSize(const AttentionRequest& request, const RequestCost& cost,
                               int64_t max_message_bytes) {
  if (cost.response_bytes > max_message_bytes) {
    const std::string limit =
        absl::StrCat("the limit is ", WithCommas(max_message_bytes), " (--max_message_bytes)");
    const int64_t weights = request.weights_elements() * 4;
    if (weights > max_message_bytes / 2) {
      return TooLargeError(absl::StrCat(
          "attn_weights would be ", WithCommas(weights), " bytes (",
          ShapeString(request.weights_shape()), " FP32); ", limit, ": ask without need_weights",
          request.per_head_weights() ? ", without per_head_weights" : "",
          " or for fewer query rows"));
    }
    return TooLargeError(absl::StrCat(
        "the response would be ", WithCommas(cost.response_bytes), " bytes (output ",
        ShapeString(request.output_shape()), " ",
        DTypeName(request.output_dtype(), DTypeSpelling::kKserve),
        weights > 0
            ? absl::StrCat(" + attn_weights ", ShapeString(request.weights_shape()), " FP32")
            : "",
        "); ", limit, ": send fewer query rows per request"));
  }
  return absl::OkStatus();
}

namespace {

// What --memory_limit_bytes is less of, for requests and for session work.
constexpr char kEnginesReserve[] = "the engines' reserve";
constexpr char kEnginesAndSessionsReserve[] = "the engines' reserve and the session cache";

// RESOURCE_EXHAUSTED for work that alone needs more than the whole budget:
// `needs` says what it needs, `reserve` what the budget is less of, `advice`
// what to send instead.
absl::Status LargerThanTheBudget(absl::string_view needs, int64_t memory_capacity,
                                 absl::string_view reserve, absl::string_view advice) {
  return TooLargeError(absl::StrCat(needs, "; the server's memory budget for requests is ",
                                    WithCommas(memory_capacity), " (--memory_limit_bytes less ",
                                    reserve, "): ", advice));
}

// "<work> needs N bytes of working memory (Q for its <inputs>, A to compute
// and answer)".
std::string WorkingMemoryNeeded(absl::string_view work, const RequestCost& cost,
                                absl::string_view inputs) {
  return absl::StrCat(work, " needs ", WithCommas(cost.total()), " bytes of working memory (",
                      WithCommas(cost.queued_bytes), " for its ", inputs, ", ",
                      WithCommas(cost.active_bytes), " to compute and answer)");
}

}  // namespace

absl::Status CheckWorkingMemory(const AttentionRequest& request, const RequestCost& cost,
                                int64_t memory_capacity) {
  if (cost.total() <= memory_capacity) return absl::OkStatus();
  return LargerThanTheBudget(
      WorkingMemoryNeeded("the request", cost, "inputs"), memory_capacity, kEnginesReserve,
      request.need_weights() ? "send fewer or shorter sequences or ask without need_weights"
                             : "send fewer or shorter sequences");
}

absl::Status CheckStepMemory(const RequestCost& cost, int64_t memory_capacity) {
  if (cost.total() <= memory_capacity) return absl::OkStatus();
  return LargerThanTheBudget(WorkingMemoryNeeded("the step", cost, "query"), memory_capacity,
                             kEnginesAndSessionsReserve,
                             "send fewer tokens per step or ask without need_weights");
}

absl::Status CheckFitsBudget(const Task& task, int64_t memory_capacity) {
  const RequestCost cost{.queued_bytes = task.queued_bytes, .active_bytes = task.active_bytes};
  switch (task.kind()) {
    case Task::Kind::kAttend:
      return CheckWorkingMemory(static_cast<const AttendCall&>(task).input(), cost,
                                memory_capacity);
    case Task::Kind::kStep:
      return CheckStepMemory(cost, memory_capacity);
    case Task::Kind::kProjection:
      if (task.queued_bytes <= memory_capacity) return absl::OkStatus();
      return LargerThanTheBudget(
          absl::StrCat("the session's encoder memory needs ", WithCommas(task.queued_bytes),
                       " bytes of working memory to be projected"),
          memory_capacity, kEnginesAndSessionsReserve, "send a shorter memory");
  }
  return absl::OkStatus();
}

absl::Status MemoryBudgetFull(int64_t reserved, int64_t capacity, const char* work, int64_t bytes,
                              const char* purpose) {
  return absl::ResourceExhaustedError(
      absl::StrCat("server memory budget full: requests in flight hold ", WithCommas(reserved),
                   " of ", WithCommas(capacity), " bytes and this ", work, " needs ",
                   WithCommas(bytes), " ", purpose, "; retry later"));
}

MemoryBudget::Growth ReserveActive(MemoryBudget* budget, Task& task) {
  if (budget == nullptr) return MemoryBudget::Growth::kGrown;
  return budget->TryGrowActive(task.active_bytes, *task.memory);
}

const char* NounOf(const Task& task) {
  switch (task.kind()) {
    case Task::Kind::kAttend:
      return "request";
    case Task::Kind::kStep:
      return "step";
    case Task::Kind::kProjection:
      return "encoder memory";
  }
  return "task";
}

absl::Status Unwanted(Task& task, absl::Time now, const ModelMetrics& metrics, const char* stage) {
  // gRPC cancels a call whose deadline passed, by its own clock, which may
  // run a little ahead of ours: a cancellation that close to the deadline
  // is the deadline's.
  constexpr absl::Duration kClockSlack = absl::Milliseconds(100);
  const bool cancelled = task.Cancelled();
  if (now > task.deadline || (cancelled && now + kClockSlack > task.deadline)) {
    task.CountDropped(metrics, "deadline");
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while the ", NounOf(task), " was ", stage));
  }
  if (cancelled) {
    task.CountDropped(metrics, "cancelled");
    return absl::CancelledError("client cancelled the request");
  }
  return absl::OkStatus();
}

}  // namespace mha::server
