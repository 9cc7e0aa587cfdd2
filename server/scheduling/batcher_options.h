// What a model version's batcher is told: its batching, queue limits,
// priority levels, and the server's pool, memory budget, clock and
// statistics it borrows. Read by the batcher and each of its parts.
#ifndef MHA_SERVER_SCHEDULING_BATCHER_OPTIONS_H_
#define MHA_SERVER_SCHEDULING_BATCHER_OPTIONS_H_

#include <algorithm>
#include <cstdint>

#include "absl/time/time.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/memory_budget.h"

namespace mha::server {

class WorkerPool;

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

// One engine call's token limits, resolved from the options.
struct CallTokens {
  int64_t max = 0;         // max_batch_tokens (0 resolved)
  int64_t with_steps = 0;  // max_batch_tokens_with_steps (0 resolved), at most `max`

  // With `threads_per_call` threads in each engine call.
  static CallTokens Resolve(const BatcherOptions& options, int threads_per_call) {
    CallTokens t;
    t.max = options.max_batch_tokens > 0 ? options.max_batch_tokens
                                         : BatcherOptions::kTokensPerThread * threads_per_call;
    t.with_steps = options.max_batch_tokens_with_steps > 0
                       ? std::min(options.max_batch_tokens_with_steps, t.max)
                       : t.max;
    return t;
  }
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_BATCHER_OPTIONS_H_
