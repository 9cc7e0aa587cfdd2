// The server's engine workers: a fixed pool of threads, each with one
// engine workspace and one OpenMP team, that serves the queues of every
// model and version. The number of threads follows --workers and the
// cores, never the number of models.
#ifndef MHA_SERVER_SCHEDULING_WORKER_POOL_H_
#define MHA_SERVER_SCHEDULING_WORKER_POOL_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <list>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "engine/mutex.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/memory_budget.h"

namespace mha {
class Workspace;
}  // namespace mha

namespace mha::server {

// One piece of work a queue hands a worker: an engine call and what it
// answers, or tasks that need a workspace. Run exactly once, on a worker.
class PoolWork {
 public:
  virtual ~PoolWork() = default;
  virtual void Run(Workspace& ws) = 0;
  // Whether waiting steps may run inside it, at its yield points: a long
  // call. A short one says no: the steps ride in the next call instead.
  virtual bool MayYield() const { return true; }
};

// A queue the pool serves (a model version's batcher).
class PoolQueue {
 public:
  virtual ~PoolQueue() = default;
  // What Poll found when it has nothing to run now.
  struct Idle {
    // When work may become ready without a Wake (a batch's queue delay).
    absl::Time retry_at = absl::InfiniteFuture();
    // Memory held by computing requests will come back: poll again soon.
    bool waiting_for_memory = false;
  };
  // The next work that may run now, or null (then `idle` says when to ask
  // again). Called with the pool's lock held: it must not block, and it
  // must not call back into the pool.
  virtual std::unique_ptr<PoolWork> Poll(Idle& idle) = 0;
  // After Poll handed out work: whether the queue holds nothing more that
  // could run without a Wake. The pool then wakes no other worker for it
  // (at one client, each request woke the second worker for nothing). Called
  // with the pool's lock held, as Poll.
  virtual bool Empty() { return false; }
  // After Poll handed out work: whether session steps are still ready (the
  // work left them for later): the queue stays first in line, and a long
  // call's yield may take them. Called with the pool's lock held, as Poll.
  virtual bool StepsReady() { return false; }
  // The session steps that may start now, alone (no Attend request, no
  // projection), or null: what a worker runs when a long call yields to
  // waiting steps. Called with the pool's lock held, as Poll.
  virtual std::unique_ptr<PoolWork> PollSteps() { return nullptr; }
};

struct WorkerPoolOptions {
  int workers = 1;  // threads calling the engine
  // Threads per engine call. 0: a call that starts while no other runs
  // gets all cores, one that starts beside others its share (cores /
  // workers); the two may overlap until the first ends.
  int compute_threads = 0;
  int cores = 0;  // the cores calls share (0: those this process may use)
  // What queue delays are measured with (borrowed; null: the real clock);
  // the same clock as the queues'.
  const Clock* clock = nullptr;
  // A workspace that a call grew above MhaEngine::kWorkspaceKeepBytes, up
  // to this many bytes in all, stays with its worker until the worker has
  // made no call for kTrimQuiet; a larger one goes back after its call. 0:
  // every such workspace goes back after its call.
  int64_t workspace_hold_bytes = 0;
  // Where a held workspace's bytes above the keep are reserved while it is
  // held (borrowed; null: nowhere); when they do not fit, it goes back at
  // once.
  MemoryBudget* memory = nullptr;
};

// What a worker may hold of a large call's workspace (workspace_hold_bytes)
// under the server's memory limit: a sixteenth of the limit, at most
// kWorkspaceHoldMax. The bytes held above the keep are reserved in the
// memory budget while they are held (WorkerPoolOptions::memory), for at
// most kTrimQuiet after the worker's last call that needed them, or until
// a request waits for memory. Freed after
// every call, a large call's workspace was faulted in again by the next,
// and gRPC's own buffers were slower too (16 x 1024 fp32 at E = 256 on the
// AMD EPYC VM, alternated: 524 against 344 page faults a call, the server's
// CPU 228 against 196 ms a call, the cost above compute 34.1 against 24.6
// ms; docs/PERFORMANCE.md).
inline constexpr int64_t kWorkspaceHoldMax = int64_t{512} << 20;
int64_t WorkspaceHoldBytes(int64_t memory_limit);

// Owns the worker threads, their workspaces and the list of queues it
// serves (borrowed: each stays attached from Attach to Detach). Workers
// take the next ready queue round-robin, starting after the queue served
// last, so that no model starves another; queues woken for session steps
// go before the others (in the same round-robin order). A long call yields
// to waiting steps: between its blocks (Workspace::BetweenBlocks), its
// worker runs the steps (PollSteps) on a second workspace when every worker
// is in a call. Thread-safe; Wake never blocks on
// compute. Detach must not be called from a worker that is running that
// queue's work.
class WorkerPool {
 public:
  explicit WorkerPool(WorkerPoolOptions options);
  ~WorkerPool();  // joins the workers; every queue must be detached

  class Registration;
  // Starts serving `queue`; the handle is for Wake and Detach.
  Registration* Attach(PoolQueue* queue);
  // Stops serving it; returns once no worker runs its work.
  void Detach(Registration* registration);
  // The queue may have work now; `steps`: session steps, which go first
  // and make StepsRecently true for kStepsRecent.
  void Wake(Registration* registration, bool steps = false);
  // Makes StepsRecently true now: called before a step is queued, so a
  // worker that finds the step already forms its call under the cap.
  void NoteStepsArrive();
  // Whether a queue was woken for steps within the last kStepsRecent (on
  // the pool's clock): sessions are stepping on this server, so queues
  // keep their calls short (BatcherOptions::max_batch_tokens_with_steps).
  static constexpr absl::Duration kStepsRecent = absl::Milliseconds(100);
  bool StepsRecently() const;
  // Whether a queue was woken for steps within the last kSessionsInUse:
  // long calls offer yields to steps only then (a key-tiled call in waves
  // is ~1.5 % slower than in one go).
  static constexpr absl::Duration kSessionsInUse = absl::Seconds(10);
  bool SessionsInUse() const;
  // Whether every worker is in an engine call now (a moment's view): work
  // queued then waits behind a running call, not only for a worker to wake.
  bool AllWorkersBusy() const {
    return calls_running_.load(std::memory_order_relaxed) >= workers();
  }

  int workers() const { return static_cast<int>(threads_.size()); }
  // A worker's second workspace (for the steps it runs inside a long call)
  // gives its buffers back above this.
  static constexpr size_t kYieldWorkspaceKeepBytes = size_t{8} << 20;
  // What the workers' workspaces may keep between calls, together.
  int64_t KeptWorkspaceBytes() const;
  // What the workers' workspaces hold now, together, as of each one's last
  // call (mha_memory_held_bytes{kind="workspaces"}).
  int64_t WorkspaceBytesHeld() const { return workspace_bytes_held_.load(); }
  // Calls of steps run inside another call's yield so far.
  uint64_t CallsRunInYields() const { return calls_run_in_yields_.load(); }
  // The most threads one engine call uses (what its memory is charged for).
  int MaxThreadsPerCall() const { return all_threads_; }
  // Every thread count its calls run with (what models warm up for).
  std::vector<int> CallThreadCounts() const;
  // On a worker, inside PoolWork::Run: the threads the pool gave this call
  // (the calling thread's SetComputeThreads). 0 elsewhere.
  static int ThreadsOfThisCall();

 private:
  void WorkerLoop(bool lead);
  // With mu_ held: the next work, round-robin; null when none is ready
  // (then `wait_until` and `memory_wait` say how long to sleep).
  std::unique_ptr<PoolWork> NextWork(Registration*& from, absl::Time& wait_until, bool& memory_wait)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One round-robin scan of NextWork; `steps_only`: only queues woken for
  // steps.
  std::unique_ptr<PoolWork> Scan(bool steps_only, absl::Time now, Registration*& from,
                                 absl::Time& wait_until, bool& memory_wait)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks whether `r` was woken for steps since its last poll.
  void SetSteps(Registration& r, bool steps) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's yield point inside a call (with mu_ not held): when steps
  // wait and every worker is in a call, runs one queue's ready steps on
  // `step_ws` (made at first use).
  void YieldToSteps(std::unique_ptr<Workspace>& step_ws) ABSL_LOCKS_EXCLUDED(mu_);
  // The condition variable to notify for new work: the lead's if it waits
  // (and then it counts as woken).
  CondVar& WorkerToWake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After `from`'s work ran and was destroyed (mu_ held): Detach may go on.
  void WorkDone(Registration* from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Threads of a call that starts while no other runs, and beside others.
  const int all_threads_, share_threads_;
  const Clock& clock_;
  const int64_t workspace_hold_bytes_;
  MemoryBudget* const memory_;
  Mutex mu_;
  // New work wakes the lead worker (0) first when it waits, the others
  // (on work_cv_) only when it does not: at one client every call runs on
  // the same thread and OpenMP team. When idle workers took turns (one
  // condition variable wakes the longest waiter), each call began on a
  // thread and team idle since the call before last: 1 x 16 requests were
  // ~2x slower than with --workers=1 on an AMD EPYC VM.
  CondVar lead_cv_;
  bool lead_waiting_ ABSL_GUARDED_BY(mu_) = false;
  CondVar work_cv_;  // a queue was woken, or stopping
  CondVar idle_cv_;  // a queue's work finished (Detach waits), a worker waits
  int workers_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // that ever waited: the constructor
  std::list<Registration> queues_ ABSL_GUARDED_BY(mu_);
  std::list<Registration>::iterator next_ ABSL_GUARDED_BY(mu_);  // where the next scan starts
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int> calls_running_{0};             // engine calls running now
  std::atomic<int64_t> workspace_bytes_held_{0};  // every worker's, after its last call
  // Queues woken for steps since their last poll (changed with mu_ held;
  // read without it at a yield point).
  std::atomic<int> step_queues_{0};
  std::atomic<uint64_t> calls_run_in_yields_{0};
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min();
  std::atomic<int64_t> steps_woken_at_ns_{kNever};  // clock_'s Unix nanoseconds
  std::vector<std::thread> threads_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_WORKER_POOL_H_
