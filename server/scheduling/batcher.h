// The dynamic ragged batcher: merges concurrent requests of one model into
// one engine call, back to back, never padded.
#ifndef MHA_SERVER_SCHEDULING_BATCHER_H_
#define MHA_SERVER_SCHEDULING_BATCHER_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/append_batch.h"
#include "engine/attention_request.h"
#include "engine/ragged_batch.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/memory_budget.h"
#include "server/scheduling/worker_pool.h"

namespace mha {
class MhaEngine;
class Workspace;
}  // namespace mha

namespace mha::server {

struct BatcherOptions {
  // The default max_batch_tokens per thread of an engine call: each
  // thread's share of a batch's activations stays near its L2 cache.
  static constexpr int64_t kTokensPerThread = 1024;

  bool enabled = true;               // false: one request per engine call
  // Query + key tokens per engine call; 0: kTokensPerThread per thread.
  int64_t max_batch_tokens = 0;
  // The default max_batch_tokens_with_steps (docs/PERFORMANCE.md: the curve).
  static constexpr int64_t kTokensWithSteps = 256;
  // The cap on a call's Attend tokens while sessions step on the server
  // (WorkerPool::StepsRecently): a step waits at most for one such call
  // before its own. 0: max_batch_tokens (no cap).
  int64_t max_batch_tokens_with_steps = kTokensWithSteps;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int64_t max_queue_size = 1024;     // requests waiting
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
  int workers = 1;                   // threads calling the engine, own pool only
  int compute_threads = 0;           // threads per engine call, own pool only (0: cores / workers)
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

// Session steps riding along in one of a batcher's engine calls: taken by
// a worker (StepSource::TakeSteps), computed with that call's Attend
// requests, answered by Finish on the same worker.
class StepGroup {
 public:
  virtual ~StepGroup() = default;
  virtual const AppendBatch& batch() const = 0;
  virtual bool need_weights() const = 0;
  // Answers every step: with the call's status and, when OK, the steps'
  // outputs and weights (views valid during the call only). Called again
  // (with an error) when an answer threw: answers only the rest.
  virtual void Finish(const absl::Status& status, absl::Span<const float> output,
                      absl::Span<const float> weights) = 0;
};

// What gives a batcher session steps (SessionManager). Thread-safe.
class StepSource {
 public:
  virtual ~StepSource() = default;
  // The steps `engine`'s next call may carry, at most `max_tokens` new
  // tokens; null when none can run now.
  virtual std::unique_ptr<StepGroup> TakeSteps(const MhaEngine& engine, int64_t max_tokens) = 0;
};

// Owns one model version's queue: forms its engine calls, which the
// server's worker pool runs (a PoolQueue of it). Borrows the engine, the
// pool, the metrics and the clock, which must outlive it, and the step
// source, which must leave first (SetStepSource(nullptr)). Owns the queued
// tasks too. Its engine calls carry Attend requests and session steps
// together. Every method is thread-safe; Enqueue, StepsQueued and
// RunOnWorker never block on compute; SetStepSource waits for the step
// groups of the old source; Stop waits for the pool to compute what is
// queued, so it must not run on a pool worker.
class Batcher final : public PoolQueue {
 public:
  Batcher(std::string model, const MhaEngine& engine, BatcherOptions options,
          ModelMetrics& metrics);
  ~Batcher() override;  // Stop(), then leaves the pool

  // Takes the call. It is answered exactly once: Respond (on a worker) with
  // its result, or Fail: later on a worker (dropped, or the engine failed),
  // or at once, in this thread, with RESOURCE_EXHAUSTED when the queue or
  // the memory budget is full and UNAVAILABLE when stopping.
  void Enqueue(std::unique_ptr<AttendCall> request);

  // Stops taking requests and returns once everything queued is computed.
  void Stop();

  // Sessions. The source whose steps this batcher's calls carry (borrowed;
  // null: none). Returns once no worker uses the previous one.
  void SetStepSource(StepSource* source);
  // Wakes a worker: the source has steps for this model.
  void StepsQueued();
  // Runs `task` on a worker, between engine calls, with its workspace
  // (a cross session's memory projection); false when stopping.
  bool RunOnWorker(std::function<void(Workspace&)> task);

  // Threads of one engine call.
  int ThreadsPerCall() const;

  // PoolQueue: the next work when it may run now (tasks, then a batch).
  std::unique_ptr<PoolWork> Poll(Idle& idle) override;

 private:
  // What a worker does next: tasks, then a batch of Attend requests and,
  // when `steps`, session steps from the source. Counted in flight from
  // Poll until destroyed (Stop waits for it).
  struct Work final : PoolWork {
    explicit Work(Batcher& b) : batcher(b) {}
    ~Work() override;
    void Run(Workspace& ws) override;
    Batcher& batcher;
    std::vector<std::function<void(Workspace&)>> tasks;
    std::vector<std::unique_ptr<AttendCall>> batch;
    bool steps = false;
    bool counted = false;  // in in_flight_ (set by Hand)
  };

  // Why the request cannot wait in the queue, or OK (then it is queued).
  absl::Status Admit(std::unique_ptr<AttendCall>& request);
  // With mu_ held: counts `work` in flight and returns it for the pool.
  std::unique_ptr<PoolWork> Hand(std::unique_ptr<Work> work);
  // Whether Stop may return: nothing queued or in flight (mu_ held).
  bool Drained() const;
  // Takes the next batch of Attend requests once BatchReady (see NextWork).
  std::vector<std::unique_ptr<AttendCall>> TakeBatch();
  // Closes a batch early when `steps` ride along (they never wait).
  bool BatchReady(bool steps) const;
  // Query + key tokens queued that may join the oldest request's batch, up
  // to `limit`.
  int64_t TokensJoiningOldest(int64_t limit) const;
  // The Attend tokens of the next call: max_batch_tokens_, or the cap with
  // steps while sessions step on the server.
  int64_t TokenLimit() const;
  // Reserves the active bytes of a request the next batch takes (see
  // NextWork); without a budget, always kGrown.
  MemoryBudget::Growth ReserveActive(AttendCall& request);
  void Compute(std::vector<std::unique_ptr<AttendCall>> batch, bool steps, Workspace& ws);
  // Computes the requests and the steps in one engine call and answers
  // them (the steps first); `answered` counts the requests answered and
  // `steps` is reset once finished, so an allocation failure answers only
  // the rest.
  void ComputeLive(const std::vector<std::unique_ptr<AttendCall>>& live,
                   std::unique_ptr<StepGroup>& steps, Workspace& ws, size_t& answered);
  // Adds the primitives the engine created since the last report (on any
  // worker) to the metric.
  void ReportPrimitiveCacheMisses();

  const std::string model_;
  const MhaEngine& engine_;
  const BatcherOptions options_;
  ModelMetrics& metrics_;
  const Clock& clock_;
  std::unique_ptr<WorkerPool> own_pool_;  // when options_.pool is null
  WorkerPool& pool_;
  const int64_t max_batch_tokens_;  // options_' value, 0 resolved
  const int64_t tokens_with_steps_;  // options_' max_batch_tokens_with_steps, resolved
  WorkerPool::Registration* registration_ = nullptr;

  std::mutex mu_;
  std::condition_variable drained_cv_;  // Stop waits on it
  int in_flight_ = 0;                   // works handed out; guarded by mu_
  std::deque<std::unique_ptr<AttendCall>> queue_;  // guarded by mu_
  int64_t queued_tokens_ = 0;                          // guarded by mu_
  int64_t queued_bytes_ = 0;                           // guarded by mu_
  bool stopping_ = false;                              // guarded by mu_
  bool steps_queued_ = false;                          // guarded by mu_
  std::vector<std::function<void(Workspace&)>> tasks_;  // guarded by mu_
  // Held shared by a worker from TakeSteps to Finish.
  std::shared_mutex source_mu_;
  StepSource* source_ = nullptr;  // guarded by source_mu_
  std::atomic<uint64_t> reported_misses_;  // engine's count already in the metric
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_BATCHER_H_
