#include "server/scheduling/worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <string>
#include <utility>

#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "engine/workspace.h"
#include "server/scheduling/heap_trim.h"

namespace mha::server {

// One attached queue: what the pool knows of it. Guarded by the pool's mu_.
class WorkerPool::Registration {
 public:
  explicit Registration(PoolQueue* q) : queue(q) {}
  PoolQueue* queue;
  // Asked since it was last polled. Not at Attach: a new queue holds nothing
  // until it wakes the pool (a worker that started after the Attach polled
  // it for nothing).
  bool woken = false;
  bool steps = false;                            // woken for session steps since
  bool memory_wait = false;                      // its last poll waits for memory
  absl::Time retry_at = absl::InfiniteFuture();  // its last poll's retry time
  int running = 0;                               // its works on workers now
  bool detaching = false;
};

namespace {

// How often a queue waiting for memory held by computing requests is asked
// again (real time: memory comes back on the real clock).
constexpr absl::Duration kMemoryRetry = absl::Milliseconds(2);

int Cores(const WorkerPoolOptions& o) {
  return std::max(1, o.cores > 0 ? o.cores : AvailableCores());
}

int AllThreads(const WorkerPoolOptions& o) {
  return o.compute_threads > 0 ? o.compute_threads : Cores(o);
}

int ShareThreads(const WorkerPoolOptions& o) {
  if (o.compute_threads > 0) return o.compute_threads;
  return std::max(1, Cores(o) / std::max(1, o.workers));
}

thread_local int threads_of_this_call = 0;

}  // namespace

int64_t WorkspaceHoldBytes(int64_t memory_limit) {
  return std::clamp<int64_t>(memory_limit / 16, 0, kWorkspaceHoldMax);
}

WorkerPool::WorkerPool(WorkerPoolOptions options)
    : all_threads_(AllThreads(options)),
      share_threads_(ShareThreads(options)),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      workspace_hold_bytes_(options.workspace_hold_bytes),
      memory_(options.memory),
      next_(queues_.end()) {
  for (int i = 0; i < std::max(1, options.workers); ++i) {
    threads_.emplace_back([this, i] {
      // A name that perf, top and /proc show (15 characters at most).
      pthread_setname_np(pthread_self(), ("mha-worker-" + std::to_string(i)).c_str());
      WorkerLoop(/*lead=*/i == 0);
    });
  }
  // Ready when every worker waits for work (the first work finds the lead).
  MutexLock lock(mu_);
  while (workers_waiting_ < workers()) idle_cv_.Wait(lock);
}

WorkerPool::~WorkerPool() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  lead_cv_.NotifyAll();
  work_cv_.NotifyAll();
  for (std::thread& t : threads_) t.join();
}

WorkerPool::Registration* WorkerPool::Attach(PoolQueue* queue) {
  MutexLock lock(mu_);
  queues_.emplace_back(queue);
  return &queues_.back();
}

void WorkerPool::Detach(Registration* registration) {
  MutexLock lock(mu_);
  registration->detaching = true;
  while (registration->running != 0) idle_cv_.Wait(lock);
  auto it = std::find_if(queues_.begin(), queues_.end(),
                         [registration](const Registration& r) { return &r == registration; });
  if (it == next_) ++next_;
  SetSteps(*it, false);
  queues_.erase(it);
}

void WorkerPool::NoteStepsArrive() {
  steps_woken_at_ns_.store(absl::ToUnixNanos(clock_.Now()), std::memory_order_relaxed);
}

void WorkerPool::Wake(Registration* registration, bool steps) {
  if (steps) NoteStepsArrive();
  CondVar* worker;
  {
    MutexLock lock(mu_);
    registration->woken = true;
    if (steps) SetSteps(*registration, true);
    worker = &WorkerToWake();
  }
  worker->NotifyOne();
}

CondVar& WorkerPool::WorkerToWake() {
  if (!lead_waiting_) return work_cv_;
  lead_waiting_ = false;  // the next work goes to another worker
  return lead_cv_;
}

int WorkerPool::ThreadsOfThisCall() { return threads_of_this_call; }

int64_t WorkerPool::KeptWorkspaceBytes() const {
  return workers() *
         static_cast<int64_t>(MhaEngine::kWorkspaceKeepBytes + kYieldWorkspaceKeepBytes);
}

void WorkerPool::SetSteps(Registration& r, bool steps) {
  if (r.steps != steps) step_queues_.fetch_add(steps ? 1 : -1, std::memory_order_relaxed);
  r.steps = steps;
}

std::vector<int> WorkerPool::CallThreadCounts() const {
  if (share_threads_ == all_threads_) return {all_threads_};
  return {share_threads_, all_threads_};
}

bool WorkerPool::SessionsInUse() const {
  const int64_t at = steps_woken_at_ns_.load(std::memory_order_relaxed);
  return at != kNever && clock_.Now() - absl::FromUnixNanos(at) < kSessionsInUse;
}

bool WorkerPool::StepsRecently() const {
  const int64_t at = steps_woken_at_ns_.load(std::memory_order_relaxed);
  return at != kNever && clock_.Now() - absl::FromUnixNanos(at) < kStepsRecent;
}

std::unique_ptr<PoolWork> WorkerPool::NextWork(Registration*& from, absl::Time& wait_until,
                                               bool& memory_wait) {
  const absl::Time now = clock_.Now();
  wait_until = absl::InfiniteFuture();
  memory_wait = false;
  if (queues_.empty()) return nullptr;
  if (next_ == queues_.end()) next_ = queues_.begin();
  // Steps first: a step waits at most for the calls already running.
  std::unique_ptr<PoolWork> work = Scan(/*steps_only=*/true, now, from, wait_until, memory_wait);
  if (work == nullptr) work = Scan(/*steps_only=*/false, now, from, wait_until, memory_wait);
  return work;
}

std::unique_ptr<PoolWork> WorkerPool::Scan(bool steps_only, absl::Time now, Registration*& from,
                                           absl::Time& wait_until, bool& memory_wait) {
  auto it = next_;
  for (size_t seen = 0; seen < queues_.size(); ++seen) {
    Registration& r = *it;
    if (++it == queues_.end()) it = queues_.begin();
    if (r.detaching || (steps_only && !r.steps)) continue;
    if (!r.woken && !r.memory_wait && r.retry_at > now) {
      wait_until = std::min(wait_until, r.retry_at);
      continue;
    }
    r.woken = false;
    SetSteps(r, false);
    PoolQueue::Idle idle;
    std::unique_ptr<PoolWork> work;
    try {
      work = r.queue->Poll(idle);
    } catch (const std::bad_alloc&) {  // nothing taken: ask again when memory came back
      idle.waiting_for_memory = true;
    }
    r.retry_at = idle.retry_at;
    r.memory_wait = idle.waiting_for_memory;
    if (work != nullptr) {
      ++r.running;
      from = &r;
      next_ = it;  // the next scan starts after it: round-robin
      // What it may hold more: asked again on the next scan, and another
      // worker may take it now.
      r.woken = !r.queue->Empty();
      SetSteps(r, r.queue->StepsReady());
      if (r.woken) WorkerToWake().NotifyOne();
      return work;
    }
    wait_until = std::min(wait_until, r.retry_at);
    memory_wait = memory_wait || r.memory_wait;
  }
  return nullptr;
}

void WorkerPool::YieldToSteps(std::unique_ptr<Workspace>& step_ws) {
  // Cheap when nothing waits: two relaxed loads. A free worker takes the
  // steps itself (Wake woke it).
  if (step_queues_.load(std::memory_order_relaxed) == 0 || !AllWorkersBusy()) return;
  MutexLock lock(mu_);
  if (queues_.empty()) return;
  if (next_ == queues_.end()) next_ = queues_.begin();
  auto it = next_;  // round-robin, as Scan: no model's steps starve another's
  for (size_t seen = 0; seen < queues_.size(); ++seen) {
    Registration& r = *it;
    if (++it == queues_.end()) it = queues_.begin();
    if (!r.steps || r.detaching) continue;
    SetSteps(r, false);
    std::unique_ptr<PoolWork> work;
    try {
      work = r.queue->PollSteps();
    } catch (const std::bad_alloc&) {  // nothing taken: they wait for a worker
      SetSteps(r, true);
      return;
    }
    if (work == nullptr) continue;
    SetSteps(r, r.queue->StepsReady());
    ++r.running;
    next_ = it;
    lock.Unlock();
    if (step_ws == nullptr) step_ws = MhaEngine::NewWorkspace();
    work->Run(*step_ws);  // on this call's threads; step_ws has no yield point
    work.reset();
    calls_run_in_yields_.fetch_add(1);
    step_ws->ReleaseIfAbove(kYieldWorkspaceKeepBytes);
    lock.Lock();
    WorkDone(&r);
    return;  // one call a yield: the long call goes on
  }
}

void WorkerPool::WorkDone(Registration* from) {
  if (--from->running == 0 && from->detaching) idle_cv_.NotifyAll();
}

void WorkerPool::WorkerLoop(bool lead) {
  CondVar& cv = lead ? lead_cv_ : work_cv_;
  std::unique_ptr<Workspace> ws = MhaEngine::NewWorkspace();
  std::unique_ptr<Workspace> step_ws;  // for steps run inside a long call
  bool may_yield = false;              // the running work's MayYield
  bool waited = false;                 // counted in workers_waiting_
  // When `ws`'s buffers beyond kWorkspaceKeepBytes go back, if it holds any.
  absl::Time hold_until = absl::InfiniteFuture();
  int64_t published = 0;  // this worker's part of workspace_bytes_held_
  auto publish = [&] {    // what its workspaces hold now
    const int64_t held =
        static_cast<int64_t>(ws->bytes_held() + (step_ws != nullptr ? step_ws->bytes_held() : 0));
    workspace_bytes_held_.fetch_add(held - published);
    published = held;
  };
  MemoryReservation holding;  // the held bytes above the keep, in the budget
  auto give_back = [&] {      // them now (mu_ not held)
    hold_until = absl::InfiniteFuture();
    if (MhaEngine::ReleaseLargeWorkspace(*ws)) TrimHeapSoon();
    holding.Release();
    publish();
  };
  // Whether `above_keep` bytes may stay held: reserved in the budget.
  auto reserve_held = [&](int64_t above_keep) {
    if (memory_ == nullptr) return true;
    const int64_t more = above_keep - holding.bytes();
    return more <= 0 || memory_->TryGrowActive(more, holding) == MemoryBudget::Growth::kGrown;
  };
  ws->set_between_blocks([this, &step_ws, &may_yield] {
    if (!may_yield || !SessionsInUse()) return false;  // no step is likely
    YieldToSteps(step_ws);
    return true;
  });
  MutexLock lock(mu_);
  while (true) {
    Registration* from = nullptr;
    absl::Time wait_until;
    bool memory_wait = false;
    std::unique_ptr<PoolWork> work = NextWork(from, wait_until, memory_wait);
    if (work == nullptr) {
      if (stopping_) {
        workspace_bytes_held_.fetch_sub(published);
        return;
      }
      if (hold_until <= clock_.Now() || (memory_wait && hold_until != absl::InfiniteFuture())) {
        lock.Unlock();
        give_back();
        lock.Lock();
        continue;  // the queues may have changed meanwhile
      }
      if (lead) lead_waiting_ = true;
      if (!waited) {
        waited = true;
        ++workers_waiting_;
        idle_cv_.NotifyAll();
      }
      wait_until = std::min(wait_until, hold_until);
      if (memory_wait) {
        cv.WaitFor(lock, kMemoryRetry);
      } else if (wait_until == absl::InfiniteFuture()) {
        cv.Wait(lock);
      } else {
        clock_.WaitUntil(cv, lock, wait_until);
      }
      if (lead) lead_waiting_ = false;
      continue;
    }
    // All cores for a call alone, its share for one beside others.
    threads_of_this_call = calls_running_.fetch_add(1) == 0 ? all_threads_ : share_threads_;
    lock.Unlock();
    SetComputeThreads(threads_of_this_call);
    may_yield = work->MayYield();
    work->Run(*ws);
    threads_of_this_call = 0;
    calls_running_.fetch_sub(1);  // its cores are free for the next call now
    work.reset();                 // what it held goes before the queue may be detached
    // After a large call, give its memory back to the system: the
    // workspace's buffers once this worker's calls stop (now when they are
    // more than it may hold), what glibc keeps of freed blocks once large
    // calls stop.
    const size_t held = ws->bytes_held();
    if (held > MhaEngine::kWorkspaceKeepBytes &&
        held <= static_cast<size_t>(workspace_hold_bytes_) &&
        reserve_held(static_cast<int64_t>(held - MhaEngine::kWorkspaceKeepBytes))) {
      hold_until = clock_.Now() + kTrimQuiet;
      publish();
    } else {
      give_back();
    }
    lock.Lock();
    WorkDone(from);
  }
}

}  // namespace mha::server
