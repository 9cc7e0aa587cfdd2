// The worker pool: which queue a worker serves next, and the threads a call
// gets alone and beside another.
#include "server/scheduling/worker_pool.h"

#include <pthread.h>

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
  // Works run after `gate` opens; `started` is set when one begins.
  void Add(int works, std::shared_future<void> gate = {}, std::promise<void>* started = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ += works;
    gate_ = std::move(gate);
    started_ = started;
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
};

thread_local int ScriptedQueue::Logged::works_running_here = 0;

TEST(WorkerPoolTest, QueuesWokenForStepsGoFirstThenRoundRobin) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue busy("busy", log, log_mu), attend("attend", log, log_mu),
      other("other", log, log_mu), steps("steps", log, log_mu);
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  auto* busy_r = pool.Attach(&busy);
  auto* attend_r = pool.Attach(&attend);
  auto* other_r = pool.Attach(&other);
  auto* steps_r = pool.Attach(&steps);
  std::promise<void> open, started;
  busy.Add(1, open.get_future().share(), &started);
  pool.Wake(busy_r);
  started.get_future().wait();  // the one worker is in it
  attend.Add(2);
  other.Add(2);
  steps.Add(1);
  pool.Wake(attend_r);
  pool.Wake(other_r);
  pool.Wake(steps_r, /*steps=*/true);
  EXPECT_TRUE(pool.StepsRecently());
  open.set_value();
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard<std::mutex> lock(log_mu);
      if (log.size() == 6) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto* r : {busy_r, attend_r, other_r, steps_r}) pool.Detach(r);
  // Round-robin after the steps: attend, other, attend, other (no queue
  // takes two turns while another waits).
  EXPECT_THAT(log, ::testing::ElementsAre("busy", "steps", "attend", "other", "attend", "other"));
}

// Work handed out from a queue it leaves empty wakes no other worker: at one
// client, each request used to wake the second worker for a Poll that found
// nothing (the L = 16 anomaly of issue 50). A queue that may hold more still
// wakes one.
TEST(WorkerPoolTest, AQueueLeftEmptyWakesNoOtherWorker) {
  for (const bool report_empty : {true, false}) {
    SCOPED_TRACE(report_empty ? "reports empty" : "may hold more");
    std::vector<std::string> log;
    std::mutex log_mu;
    ScriptedQueue queue("q", log, log_mu);
    queue.report_empty = report_empty;
    WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1});
    auto* registration = pool.Attach(&queue);
    constexpr int kWorks = 20;
    for (int i = 1; i <= kWorks; ++i) {
      queue.Add(1);
      pool.Wake(registration);
      for (int tries = 0; tries < 2000; ++tries) {
        {
          std::lock_guard<std::mutex> lock(log_mu);
          if (static_cast<int>(log.size()) == i) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    // Time for a worker woken for nothing to ask (it would before Detach).
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pool.Detach(registration);
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
TEST(WorkerPoolTest, ACallAloneGetsAllCoresACallBesideAnotherItsShare) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue first("first", log, log_mu, /*log_threads=*/true),
      second("second", log, log_mu, /*log_threads=*/true);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .cores = 4});
  EXPECT_EQ(pool.MaxThreadsPerCall(), 4);
  EXPECT_THAT(pool.CallThreadCounts(), ::testing::ElementsAre(2, 4));
  auto* first_r = pool.Attach(&first);
  auto* second_r = pool.Attach(&second);
  std::promise<void> open, started;
  first.Add(1, open.get_future().share(), &started);
  pool.Wake(first_r);
  started.get_future().wait();  // one worker is in it
  second.Add(1);
  pool.Wake(second_r);
  auto wait_for_log = [&](size_t entries) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> lock(log_mu);
        if (log.size() >= entries) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  wait_for_log(1);  // the second ran beside the first (which waits for the gate)
  open.set_value();
  wait_for_log(2);
  pool.Detach(first_r);  // returns once the first call is over
  second.Add(1);         // alone again
  pool.Wake(second_r);
  wait_for_log(3);
  pool.Detach(second_r);
  EXPECT_THAT(log, ::testing::ElementsAre("second/2", "first/4", "second/4"));

  WorkerPool fixed(WorkerPoolOptions{.workers = 2, .compute_threads = 3, .cores = 4});
  EXPECT_EQ(fixed.MaxThreadsPerCall(), 3);
  EXPECT_THAT(fixed.CallThreadCounts(), ::testing::ElementsAre(3));
}

// AllWorkersBusy (what /metrics splits a queued step's wait by) holds
// exactly while every worker is in a call.
TEST(WorkerPoolTest, AllWorkersBusyWhileEveryWorkerIsInACall) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue first("first", log, log_mu), second("second", log, log_mu);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1});
  auto* first_r = pool.Attach(&first);
  auto* second_r = pool.Attach(&second);
  EXPECT_FALSE(pool.AllWorkersBusy());
  std::promise<void> open, first_started, second_started;
  std::shared_future<void> gate = open.get_future().share();
  first.Add(1, gate, &first_started);
  pool.Wake(first_r);
  first_started.get_future().wait();
  EXPECT_FALSE(pool.AllWorkersBusy());  // one worker of two is in a call
  second.Add(1, gate, &second_started);
  pool.Wake(second_r);
  second_started.get_future().wait();
  EXPECT_TRUE(pool.AllWorkersBusy());
  open.set_value();
  pool.Detach(first_r);  // each returns once its call is over
  pool.Detach(second_r);
  EXPECT_FALSE(pool.AllWorkersBusy());
}

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

// Steps that arrive while every worker is in a call run inside a long call,
// between its blocks, on the worker's second workspace, one queue's call a
// yield, whatever the models: the steps of two models here, while the one
// worker is in a long call. An Attend queue's work waits for the call's end.
TEST(WorkerPoolTest, ALongCallRunsWaitingStepsBetweenItsBlocksWhenNoWorkerIsFree) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue long_call("long", log, log_mu), attend("attend", log, log_mu),
      steps_a("steps_a", log, log_mu), steps_b("steps_b", log, log_mu);
  for (ScriptedQueue* q : {&long_call, &attend, &steps_a, &steps_b}) q->log_where = true;
  steps_a.steps_lane = steps_b.steps_lane = true;
  attend.steps_lane = true;  // would hand out work, but was not woken for steps
  long_call.body = YieldUntil(log, log_mu, 2);
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  auto* long_r = pool.Attach(&long_call);
  auto* attend_r = pool.Attach(&attend);
  auto* steps_a_r = pool.Attach(&steps_a);
  auto* steps_b_r = pool.Attach(&steps_b);
  std::promise<void> started;
  long_call.Add(1, {}, &started);
  pool.Wake(long_r);
  started.get_future().wait();
  EXPECT_TRUE(pool.AllWorkersBusy());
  attend.Add(1);
  pool.Wake(attend_r);
  steps_a.Add(1);
  steps_b.Add(1);
  pool.Wake(steps_a_r, /*steps=*/true);
  pool.Wake(steps_b_r, /*steps=*/true);
  WaitForLog(log, log_mu, 4);  // the attend work too
  for (auto* r : {long_r, attend_r, steps_a_r, steps_b_r}) pool.Detach(r);
  ASSERT_EQ(log.size(), 4u);
  EXPECT_THAT(std::vector<std::string>(log.begin(), log.begin() + 2),
              ::testing::UnorderedElementsAre("steps_a/yield", "steps_b/yield"));
  EXPECT_EQ(log[2], "long/worker");
  EXPECT_EQ(log[3], "attend/worker");
  EXPECT_EQ(pool.CallsRunInYields(), 2u);
}

// The worker in a long call is never the one that takes a step another
// worker could take: with a worker free, the long call's yields run nothing.
TEST(WorkerPoolTest, AFreeWorkerTakesTheStepsNotTheLongCall) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue long_call("long", log, log_mu), steps("steps", log, log_mu);
  long_call.log_where = steps.log_where = true;
  steps.steps_lane = true;
  long_call.body = YieldUntil(log, log_mu, 1);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .compute_threads = 1, .cores = 2});
  auto* long_r = pool.Attach(&long_call);
  auto* steps_r = pool.Attach(&steps);
  std::promise<void> started;
  long_call.Add(1, {}, &started);
  pool.Wake(long_r);
  started.get_future().wait();
  EXPECT_FALSE(pool.AllWorkersBusy());
  steps.Add(1);
  pool.Wake(steps_r, /*steps=*/true);
  pool.Detach(long_r);
  pool.Detach(steps_r);
  EXPECT_THAT(log, ::testing::ElementsAre("steps/worker", "long/worker"));
  EXPECT_EQ(pool.CallsRunInYields(), 0u);
}

// A short call (MayYield false: a capped call, whose steps ride in the next
// one) runs nothing at its yield points.
TEST(WorkerPoolTest, AShortCallRunsNoStepsInItsYields) {
  std::vector<std::string> log;
  std::mutex log_mu;
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
  auto* short_r = pool.Attach(&short_call);
  auto* steps_r = pool.Attach(&steps);
  short_call.Add(1);
  pool.Wake(short_r);
  waiting.get_future().wait();
  steps.Add(1);
  pool.Wake(steps_r, /*steps=*/true);
  open.set_value();
  WaitForLog(log, log_mu, 2);
  for (auto* r : {short_r, steps_r}) pool.Detach(r);
  EXPECT_THAT(log, ::testing::ElementsAre("short/worker", "steps/worker"));
  EXPECT_EQ(pool.CallsRunInYields(), 0u);
}

// Yields take the queues with steps round-robin, one call each: two models
// whose steps keep coming share a long call's yields in turn.
TEST(WorkerPoolTest, YieldsServeTheModelsStepsInTurn) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue long_call("long", log, log_mu), steps_a("a", log, log_mu),
      steps_b("b", log, log_mu);
  steps_a.steps_lane = steps_b.steps_lane = true;
  std::promise<void> open, started;
  long_call.body = [&](Workspace& ws) {
    open.get_future().wait();  // both queues hold three calls of steps
    for (int i = 0; i < 6; ++i) ws.BetweenBlocks();
  };
  WorkerPool pool(WorkerPoolOptions{.workers = 1, .compute_threads = 1});
  auto* long_r = pool.Attach(&long_call);
  auto* a_r = pool.Attach(&steps_a);
  auto* b_r = pool.Attach(&steps_b);
  long_call.Add(1, {}, &started);
  pool.Wake(long_r);
  started.get_future().wait();
  steps_a.Add(3);
  steps_b.Add(3);
  pool.Wake(a_r, /*steps=*/true);
  pool.Wake(b_r, /*steps=*/true);
  open.set_value();
  WaitForLog(log, log_mu, 7);
  for (auto* r : {long_r, a_r, b_r}) pool.Detach(r);
  EXPECT_THAT(log, ::testing::ElementsAre("a", "b", "a", "b", "a", "b", "long"));
  EXPECT_EQ(pool.CallsRunInYields(), 6u);
}

// One call at a time (one client), each woken after the one before is over:
// every call runs on the lead worker, so its thread and OpenMP team are the
// ones the call before used. Idle workers taking turns made the default
// ~2x slower than --workers=1 on small requests.
TEST(WorkerPoolTest, OneCallAtATimeRunsOnTheLeadWorker) {
  std::vector<std::string> log;
  std::mutex log_mu;
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
    auto* r = pool.Attach(&queue);
    queue.Add(1);
    pool.Wake(r);
    WaitForLog(log, log_mu, i);
    pool.Detach(r);  // returns once its worker is back waiting
  }
  EXPECT_THAT(workers, ::testing::ElementsAre("mha-worker-0", "mha-worker-0", "mha-worker-0",
                                              "mha-worker-0", "mha-worker-0", "mha-worker-0"));
}

// Two at a time: the second goes to another worker while the lead is in a
// call (the lead is not waited for).
TEST(WorkerPoolTest, WorkBesideTheLeadsCallGoesToAnotherWorker) {
  std::vector<std::string> log;
  std::mutex log_mu;
  ScriptedQueue first("first", log, log_mu, /*log_threads=*/true),
      second("second", log, log_mu, /*log_threads=*/true);
  WorkerPool pool(WorkerPoolOptions{.workers = 2, .cores = 2});
  auto* first_r = pool.Attach(&first);
  auto* second_r = pool.Attach(&second);
  std::promise<void> open, started;
  first.Add(1, open.get_future().share(), &started);
  pool.Wake(first_r);
  started.get_future().wait();  // a worker is in it, held at the gate
  second.Add(1);
  pool.Wake(second_r);
  WaitForLog(log, log_mu, 1);
  EXPECT_THAT(log, ::testing::ElementsAre("second/1"));  // beside the first, its share
  open.set_value();
  WaitForLog(log, log_mu, 2);
  pool.Detach(first_r);
  pool.Detach(second_r);
}

// Calls run one at a time on a one-worker pool; each records the bytes its
// workspace held when it began, then grows it to `grow` bytes.
class HeldBytes {
 public:
  HeldBytes(const WorkerPoolOptions& options, size_t grow)
      : queue_("call", log_, log_mu_), pool_(options), r_(pool_.Attach(&queue_)) {
    queue_.report_empty = true;
    queue_.body = [this, grow](Workspace& ws) {
      {
        std::lock_guard<std::mutex> lock(log_mu_);
        held_.push_back(ws.bytes_held());
      }
      ws.Get<uint8_t>(Workspace::kProjQ, grow);
    };
  }
  ~HeldBytes() { pool_.Detach(r_); }
  // Runs one more call; returns what the workspace held when it began.
  size_t Call() {
    size_t before = 0;
    {
      std::lock_guard<std::mutex> lock(log_mu_);
      before = log_.size();
    }
    queue_.Add(1);
    pool_.Wake(r_);
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
  WorkerPool::Registration* r_;
};

constexpr size_t kLarge = MhaEngine::kWorkspaceKeepBytes + (size_t{1} << 20);

TEST(WorkerPoolTest, ALargeWorkspaceIsHeldUntilItsWorkersCallsStop) {
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

TEST(WorkerPoolTest, AWorkspaceAboveWhatAWorkerMayHoldGoesBackAfterItsCall) {
  testing::ManualClock clock;
  HeldBytes calls(
      WorkerPoolOptions{
          .workers = 1, .cores = 2, .clock = &clock, .workspace_hold_bytes = int64_t{kLarge - 1}},
      kLarge);
  EXPECT_EQ(calls.Call(), 0u);
  EXPECT_EQ(calls.Call(), 0u);
}

TEST(WorkerPoolTest, WithoutAHoldALargeWorkspaceGoesBackAfterEachCall) {
  HeldBytes calls(WorkerPoolOptions{.workers = 1, .cores = 2}, kLarge);
  EXPECT_EQ(calls.Call(), 0u);
  EXPECT_EQ(calls.Call(), 0u);
}

TEST(WorkerPoolTest, WhatAWorkerMayHoldFollowsTheMemoryLimit) {
  EXPECT_EQ(WorkspaceHoldBytes(int64_t{1} << 30), int64_t{64} << 20);
  EXPECT_EQ(WorkspaceHoldBytes(int64_t{24} << 30), kWorkspaceHoldMax);
  EXPECT_EQ(WorkspaceHoldBytes(0), 0);
}

}  // namespace
}  // namespace mha::server
