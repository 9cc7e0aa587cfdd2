// The worker pool: which queue a worker serves next, and the threads a call
// gets alone and beside another.
#include "server/scheduling/worker_pool.h"

#include <pthread.h>

#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "engine/workspace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/scheduling/heap_trim.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {

// A queue that hands out `pending` works, each logging its name (and with
// `log_threads`, "/" and the threads the pool gave it) when it runs, after
// `gate` opens (when set).
class ScriptedQueue final : public PoolQueue {
 public:
  ScriptedQueue(std::string name, std::vector<std::string>& log, std::mutex& log_mu,
                bool log_threads = false)
      : name_(std::move(name)), log_(log), log_mu_(log_mu), log_threads_(log_threads) {}
  // Attaches it to `pool` (which must outlive the attachment); Detach
  // returns once its works are over.
  void AttachTo(WorkerPool& pool) {
    pool_ = &pool;
    registration_ = pool.Attach(this);
  }
  void Detach() { pool_->Detach(registration_); }
  // Adds `works` and wakes a worker for them (for `steps`: see
  // WorkerPool::Wake).
  void Send(int works, bool steps = false) {
    Add(works, {}, nullptr);
    pool_->Wake(registration_, steps);
  }
  // Sends one work that waits for `gate` (when set) once it has begun, and
  // returns when it has.
  void SendAndWaitBegun(std::shared_future<void> gate = {}) {
    std::promise<void>* begun = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      begun = &begun_.emplace_back();
    }
    Add(1, std::move(gate), begun);
    pool_->Wake(registration_);
    begun->get_future().wait();
  }
  std::unique_ptr<PoolWork> Poll(Idle&) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++polls_;
    if (pending_ == 0) return nullptr;
    --pending_;
    return std::make_unique<Logged>(*this, gate_, std::exchange(started_, nullptr));
  }
  // With `report_empty`, says when it has nothing pending (as a batcher
  // does); without, the PoolQueue default (it may hold more).
  bool Empty() override {
    std::lock_guard<std::mutex> lock(mu_);
    return report_empty && pending_ == 0;
  }
  int polls() {
    std::lock_guard<std::mutex> lock(mu_);
    return polls_;
  }
  bool report_empty = false;
  // Whether PollSteps hands out its works too (a queue of session steps).
  bool steps_lane = false;
  // Run by each work before it logs (e.g. a long call's yield points).
  std::function<void(Workspace&)> body;
  // With `log_where`, each entry ends in "/yield" when the work ran inside
  // another's yield (inside its Run, on its thread), else "/worker".
  bool log_where = false;
  // What its works answer to MayYield.
  bool may_yield = true;
  std::unique_ptr<PoolWork> PollSteps() override {
    Idle idle;
    return steps_lane ? Poll(idle) : nullptr;
  }
  bool StepsReady() override {
    std::lock_guard<std::mutex> lock(mu_);
    return steps_lane && pending_ > 0;
  }

 private:
  // Works run after `gate` opens; `started` is set when one begins.
  void Add(int works, std::shared_future<void> gate, std::promise<void>* started) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ += works;
    gate_ = std::move(gate);
    started_ = started;
  }

  struct Logged final : PoolWork {
    Logged(ScriptedQueue& q, std::shared_future<void> g, std::promise<void>* s)
        : queue(q), gate(std::move(g)), started(s) {}
    void Run(Workspace& ws) override {
      const bool inside_another = works_running_here++ > 0;
      if (started != nullptr) started->set_value();
      if (gate.valid()) gate.wait();
      if (queue.body) queue.body(ws);
      std::lock_guard<std::mutex> lock(queue.log_mu_);
      std::string entry = queue.name_;
      if (queue.log_threads_) absl::StrAppend(&entry, "/", WorkerPool::ThreadsOfThisCall());
      if (queue.log_where) absl::StrAppend(&entry, inside_another ? "/yield" : "/worker");
      queue.log_.push_back(entry);
      --works_running_here;
    }
    static thread_local int works_running_here;
    bool MayYield() const override { return queue.may_yield; }
    ScriptedQueue& queue;
    std::shared_future<void> gate;
    std::promise<void>* started;
  };
  const std::string name_;
  std::vector<std::string>& log_;
  std::mutex& log_mu_;
  const bool log_threads_;
  std::mutex mu_;
  int pending_ = 0;
  int polls_ = 0;
  std::shared_future<void> gate_;
  std::promise<void>* started_ = nullptr;
  // SendAndWaitBegun's promises, kept as long as a work may still set one.
  std::deque<std::promise<void>> begun_;
  WorkerPool* pool_ = nullptr;
  WorkerPool::Registration* registration_ = nullptr;
};

thread_local int ScriptedQueue::Logged::works_running_here = 0;

// Waits until the log holds `entries` entries, for at most ten seconds,
// calling `each_time` before each look.
void WaitForLog(
    std::vector<std::string>& log, std::mutex& log_mu, size_t entries,
    const std::function<void()>& each_time = [] {}) {
  for (int i = 0; i < 10000; ++i) {
    each_time();
    {
      std::lock_guard<std::mutex> lock(log_mu);
      if (log.size() >= entries) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A long call's body: passes its yield points (Workspace::BetweenBlocks)
// until the log holds `entries` entries, for at most ten seconds.
std::function<void(Workspace&)> YieldUntil(std::vector<std::string>& log, std::mutex& log_mu,
                                           size_t entries) {
  return [&log, &log_mu, entries](Workspace& ws) {
    WaitForLog(log, log_mu, entries, [&ws] { ws.BetweenBlocks(); });
  };
}

// Every test's log of the works that ran, for its ScriptedQueues.
class WorkerPoolTest : public ::testing::Test {
 protected:
  std::vector<std::string> log;
  std::mutex log_mu;
};

TEST_F(WorkerPoolTest, QueuesWokenForStepsGoFirstThenRoundRobin) {
  ScriptedQueue busy("busy", log, log_mu), attend("attend", log, log_mu),
      other("other", log, log_mu), steps("steps", log, log_mu);
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  for (ScriptedQueue* q : {&busy, &attend, &other, &steps}) q->AttachTo(pool);
  std::promise<void> open;
  busy.SendAndWaitBegun(open.get_future().share());  // the one worker is in it
  attend.Send(2);
  other.Send(2);
  steps.Send(1, /*steps=*/true);
  EXPECT_TRUE(pool.StepsRecently());
  open.set_value();
  WaitForLog(log, log_mu, 6);
  for (ScriptedQueue* q : {&busy, &attend, &other, &steps}) q->Detach();
  // Round-robin after the steps: attend, other, attend, other (no queue
  // takes two turns while another waits).
  EXPECT_THAT(log, ::testing::ElementsAre("busy", "steps", "attend", "other", "attend", "other"));
}

// Work handed out from a queue it leaves empty wakes no other worker: at one
// client, each request used to wake the second worker for a Poll that found
// nothing (the L = 16 anomaly of issue 50). A queue that may hold more still
// wakes one.
TEST_F(WorkerPoolTest, AQueueLeftEmptyWakesNoOtherWorker) {
  for (const bool report_empty : {true, false}) {
    SCOPED_TRACE(report_empty ? "reports empty" : "may hold more");
    log.clear();  // the pool of the round before is gone
    ScriptedQueue queue("q", log, log_mu);
    queue.report_empty = report_empty;
    WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1});
    queue.AttachTo(pool);
    constexpr int kWorks = 20;
    for (int i = 1; i <= kWorks; ++i) {
      queue.Send(1);
      WaitForLog(log, log_mu, i);
    }
    // Time for a worker woken for nothing to ask (it would before Detach).
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    queue.Detach();
    EXPECT_EQ(log.size(), size_t{kWorks});
    if (report_empty) {
      EXPECT_EQ(queue.polls(), kWorks) << "one Poll per work: no worker woken for nothing";
    } else {
      EXPECT_GT(queue.polls(), kWorks) << "the other worker asks again";
    }
  }
}

// With --intra_op_threads=0, a call gets the cores no other call holds: all
// of them when it starts alone, its share (cores / workers) when it starts
// beside another; a set --intra_op_threads is every call's.
TEST_F(WorkerPoolTest, ACallAloneGetsAllCoresACallBesideAnotherItsShare) {
  ScriptedQueue first("first", log, log_mu, /*log_threads=*/true),
      second("second", log, log_mu, /*log_threads=*/true);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .cores = 4});
  EXPECT_EQ(pool.MaxThreadsPerCall(), 4);
  EXPECT_THAT(pool.CallThreadCounts(), ::testing::ElementsAre(2, 4));
  first.AttachTo(pool);
  second.AttachTo(pool);
  std::promise<void> open;
  first.SendAndWaitBegun(open.get_future().share());  // one worker is in it
  second.Send(1);
  WaitForLog(log, log_mu, 1);  // the second ran beside the first (which waits for the gate)
  open.set_value();
  WaitForLog(log, log_mu, 2);
  first.Detach();  // returns once the first call is over
  second.Send(1);  // alone again
  WaitForLog(log, log_mu, 3);
  second.Detach();
  EXPECT_THAT(log, ::testing::ElementsAre("second/2", "first/4", "second/4"));

  WorkerPool fixed(WorkerPoolOptions{.workers = 2, .compute_threads = 3, .cores = 4});
  EXPECT_EQ(fixed.MaxThreadsPerCall(), 3);
  EXPECT_THAT(fixed.CallThreadCounts(), ::testing::ElementsAre(3));
}

// AllWorkersBusy (what /metrics splits a queued step's wait by) holds
// exactly while every worker is in a call.
TEST_F(WorkerPoolTest, AllWorkersBusyWhileEveryWorkerIsInACall) {
  ScriptedQueue first("first", log, log_mu), second("second", log, log_mu);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1});
  first.AttachTo(pool);
  second.AttachTo(pool);
  EXPECT_FALSE(pool.AllWorkersBusy());
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  first.SendAndWaitBegun(gate);
  EXPECT_FALSE(pool.AllWorkersBusy());  // one worker of two is in a call
  second.SendAndWaitBegun(gate);
  EXPECT_TRUE(pool.AllWorkersBusy());
  open.set_value();
  first.Detach();  // each returns once its call is over
  second.Detach();
  EXPECT_FALSE(pool.AllWorkersBusy());
}

// Steps that arrive while every worker is in a call run inside a long call,
// between its blocks, on the worker's second workspace, one queue's call a
// yield, whatever the models: the steps of two models here, while the one
// worker is in a long call. An Attend queue's work waits for the call's end.
TEST_F(WorkerPoolTest, ALongCallRunsWaitingStepsBetweenItsBlocksWhenNoWorkerIsFree) {
  ScriptedQueue long_call("long", log, log_mu), attend("attend", log, log_mu),
      steps_a("steps_a", log, log_mu), steps_b("steps_b", log, log_mu);
  for (ScriptedQueue* q : {&long_call, &attend, &steps_a, &steps_b}) q->log_where = true;
  steps_a.steps_lane = steps_b.steps_lane = true;
  attend.steps_lane = true;  // would hand out work, but was not woken for steps
  long_call.body = YieldUntil(log, log_mu, 2);
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  for (ScriptedQueue* q : {&long_call, &attend, &steps_a, &steps_b}) q->AttachTo(pool);
  long_call.SendAndWaitBegun();
  EXPECT_TRUE(pool.AllWorkersBusy());
  attend.Send(1);
  steps_a.Send(1, /*steps=*/true);
  steps_b.Send(1, /*steps=*/true);
  WaitForLog(log, log_mu, 4);  // the attend work too
  for (ScriptedQueue* q : {&long_call, &attend, &steps_a, &steps_b}) q->Detach();
  ASSERT_EQ(log.size(), 4u);
  EXPECT_THAT(std::vector<std::string>(log.begin(), log.begin() + 2),
              ::testing::UnorderedElementsAre("steps_a/yield", "steps_b/yield"));
  EXPECT_EQ(log[2], "long/worker");
  EXPECT_EQ(log[3], "attend/worker");
  EXPECT_EQ(pool.CallsRunInYields(), 2u);
}

// The worker in a long call is never the one that takes a step another
// worker could take: with a worker free, the long call's yields run nothing.
TEST_F(WorkerPoolTest, AFreeWorkerTakesTheStepsNotTheLongCall) {
  ScriptedQueue long_call("long", log, log_mu), steps("steps", log, log_mu);
  long_call.log_where = steps.log_where = true;
  steps.steps_lane = true;
  long_call.body = YieldUntil(log, log_mu, 1);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1, .cores = 2});
  long_call.AttachTo(pool);
  steps.AttachTo(pool);
  long_call.SendAndWaitBegun();
  EXPECT_FALSE(pool.AllWorkersBusy());
  steps.Send(1, /*steps=*/true);
  long_call.Detach();
  steps.Detach();
  EXPECT_THAT(log, ::testing::ElementsAre("steps/worker", "long/worker"));
  EXPECT_EQ(pool.CallsRunInYields(), 0u);
}

// A short call (MayYield false: a capped call, whose steps ride in the next
// one) runs nothing at its yield points.
TEST_F(WorkerPoolTest, AShortCallRunsNoStepsInItsYields) {
  ScriptedQueue short_call("short", log, log_mu), steps("steps", log, log_mu);
  short_call.log_where = steps.log_where = true;
  short_call.may_yield = false;
  steps.steps_lane = true;
  std::promise<void> open, waiting;
  short_call.body = [&](Workspace& ws) {
    waiting.set_value();
    open.get_future().wait();  // the step is ready now
    for (int i = 0; i < 20; ++i) ws.BetweenBlocks();
  };
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  short_call.AttachTo(pool);
  steps.AttachTo(pool);
  short_call.Send(1);
  waiting.get_future().wait();
  steps.Send(1, /*steps=*/true);
  open.set_value();
  WaitForLog(log, log_mu, 2);
  short_call.Detach();
  steps.Detach();
  EXPECT_THAT(log, ::testing::ElementsAre("short/worker", "steps/worker"));
  EXPECT_EQ(pool.CallsRunInYields(), 0u);
}

// Yields take the queues with steps round-robin, one call each: two models
// whose steps keep coming share a long call's yields in turn.
TEST_F(WorkerPoolTest, YieldsServeTheModelsStepsInTurn) {
  ScriptedQueue long_call("long", log, log_mu), steps_a("a", log, log_mu),
      steps_b("b", log, log_mu);
  steps_a.steps_lane = steps_b.steps_lane = true;
  std::promise<void> open;
  long_call.body = [&](Workspace& ws) {
    open.get_future().wait();  // both queues hold three calls of steps
    for (int i = 0; i < 6; ++i) ws.BetweenBlocks();
  };
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  for (ScriptedQueue* q : {&long_call, &steps_a, &steps_b}) q->AttachTo(pool);
  long_call.SendAndWaitBegun();
  steps_a.Send(3, /*steps=*/true);
  steps_b.Send(3, /*steps=*/true);
  open.set_value();
  WaitForLog(log, log_mu, 7);
  for (ScriptedQueue* q : {&long_call, &steps_a, &steps_b}) q->Detach();
  EXPECT_THAT(log, ::testing::ElementsAre("a", "b", "a", "b", "a", "b", "long"));
  EXPECT_EQ(pool.CallsRunInYields(), 6u);
}

// One call at a time (one client), each woken after the one before is over:
// every call runs on the lead worker, so its thread and OpenMP team are the
// ones the call before used. Idle workers taking turns made the default
// ~2x slower than --workers=1 on small requests.
TEST_F(WorkerPoolTest, OneCallAtATimeRunsOnTheLeadWorker) {
  ScriptedQueue queue("call", log, log_mu);
  queue.report_empty = true;         // as a batcher: no other worker is woken for more
  std::vector<std::string> workers;  // each call's thread name, under log_mu
  queue.body = [&](Workspace&) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof name);
    std::lock_guard<std::mutex> lock(log_mu);
    workers.push_back(name);
  };
  WorkerPool pool(WorkerPoolOptions{.workers = 3, .cores = 2});
  for (size_t i = 1; i <= 6; ++i) {
    queue.AttachTo(pool);
    queue.Send(1);
    WaitForLog(log, log_mu, i);
    queue.Detach();  // returns once its worker is back waiting
  }
  EXPECT_THAT(workers, ::testing::ElementsAre("mha-worker-0", "mha-worker-0", "mha-worker-0",
                                              "mha-worker-0", "mha-worker-0", "mha-worker-0"));
}

// Two at a time: the second goes to another worker while the lead is in a
// call (the lead is not waited for).
TEST_F(WorkerPoolTest, WorkBesideTheLeadsCallGoesToAnotherWorker) {
  ScriptedQueue first("first", log, log_mu, /*log_threads=*/true),
      second("second", log, log_mu, /*log_threads=*/true);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .cores = 2});
  first.AttachTo(pool);
  second.AttachTo(pool);
  std::promise<void> open;
  first.SendAndWaitBegun(open.get_future().share());  // a worker is in it, held at the gate
  second.Send(1);
  WaitForLog(log, log_mu, 1);
  EXPECT_THAT(log, ::testing::ElementsAre("second/1"));  // beside the first, its share
  open.set_value();
  WaitForLog(log, log_mu, 2);
  first.Detach();
  second.Detach();
}

// Calls run one at a time on a one-worker pool; each records the bytes its
// workspace held when it began, then grows it to `grow` bytes.
class HeldBytes {
 public:
  HeldBytes(const WorkerPoolOptions& options, size_t grow)
      : queue_("call", log_, log_mu_), pool_(options) {
    queue_.AttachTo(pool_);
    queue_.report_empty = true;
    queue_.body = [this, grow](Workspace& ws) {
      {
        std::lock_guard<std::mutex> lock(log_mu_);
        held_.push_back(ws.bytes_held());
      }
      ws.Get<uint8_t>(Workspace::kProjQ, grow);
    };
  }
  ~HeldBytes() { queue_.Detach(); }
  // Runs one more call; returns what the workspace held when it began.
  size_t Call() {
    size_t before = 0;
    {
      std::lock_guard<std::mutex> lock(log_mu_);
      before = log_.size();
    }
    queue_.Send(1);
    WaitForLog(log_, log_mu_, before + 1);
    std::lock_guard<std::mutex> lock(log_mu_);
    return held_.back();
  }

 private:
  std::vector<std::string> log_;
  std::mutex log_mu_;
  std::vector<size_t> held_;
  ScriptedQueue queue_;
  WorkerPool pool_;
};

constexpr size_t kLarge = MhaEngine::kWorkspaceKeepBytes + (size_t{1} << 20);

TEST_F(WorkerPoolTest, ALargeWorkspaceIsHeldUntilItsWorkersCallsStop) {
  testing::ManualClock clock;
  HeldBytes calls(
      WorkerPoolOptions{
          .workers = 1, .cores = 2, .clock = &clock, .workspace_hold_bytes = int64_t{256} << 20},
      kLarge);
  EXPECT_EQ(calls.Call(), 0u);
  EXPECT_GE(calls.Call(), kLarge);  // the next call finds it
  clock.Advance(kTrimQuiet - absl::Milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_GE(calls.Call(), kLarge);  // calls went on: still held
  clock.Advance(kTrimQuiet + absl::Milliseconds(1));
  // The idle worker looks at the clock every millisecond (ManualClock).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(calls.Call(), 0u);  // given back once they stopped
}

TEST_F(WorkerPoolTest, AWorkspaceAboveWhatAWorkerMayHoldGoesBackAfterItsCall) {
  testing::ManualClock clock;
  HeldBytes calls(
      WorkerPoolOptions{
          .workers = 1, .cores = 2, .clock = &clock, .workspace_hold_bytes = int64_t{kLarge - 1}},
      kLarge);
  EXPECT_EQ(calls.Call(), 0u);
  EXPECT_EQ(calls.Call(), 0u);
}

TEST_F(WorkerPoolTest, WithoutAHoldALargeWorkspaceGoesBackAfterEachCall) {
  HeldBytes calls(WorkerPoolOptions{.workers = 1, .cores = 2}, kLarge);
  EXPECT_EQ(calls.Call(), 0u);
  EXPECT_EQ(calls.Call(), 0u);
}

TEST_F(WorkerPoolTest, WhatAWorkerMayHoldFollowsTheMemoryLimit) {
  EXPECT_EQ(WorkspaceHoldBytes(int64_t{1} << 30), int64_t{64} << 20);
  EXPECT_EQ(WorkspaceHoldBytes(int64_t{24} << 30), kWorkspaceHoldMax);
  EXPECT_EQ(WorkspaceHoldBytes(0), 0);
}

}  // namespace
}  // namespace mha::server
