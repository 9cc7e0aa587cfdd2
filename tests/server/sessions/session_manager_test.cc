// SessionManager: steps of many sessions from many threads (also under
// ThreadSanitizer), ordering of one session's queued steps, expiry on a
// manual clock (and its thread left asleep by steps), eviction, steps
// sharing the batcher's engine calls with Attend requests, and steps
// admitted as Attend requests are (memory, deadline, cancellation).
#include "server/sessions/session_manager.h"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "server/scheduling/admission.h"
#include "server/scheduling/memory_budget.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/test_models.h"
#include "tests/server/scheduling/callback_call.h"
#include "tests/server/scheduling/manual_clock.h"

namespace mha::server {
namespace {

using testing::MakeDims;
using testing::MaxAbsDiff;
using testing::RandomVector;
using testing::RandomWeights;

constexpr int64_t kE = 32;

Metrics& TestMetrics() {
  static Metrics* metrics = new Metrics;
  return *metrics;
}

// A version with its batcher, as the repository makes them.
VersionPtr MakeVersion(BatcherOptions options = {}, int64_t embed_dim = kE,
                       const std::string& name = "m", bool bf16 = false, bool int8 = false) {
  AttentionDims d = MakeDims(embed_dim, 4);
  d.bf16 = bf16;  // computed in bf16 where the CPU can (its cache then bf16 too)
  d.kv_cache_int8 = int8;
  auto version = std::make_shared<ModelVersion>();
  version->name = name;
  version->version = 1;
  version->loaded.dims = d;
  version->loaded.engine = testing::MakeEngine(d, RandomWeights(d, 3));
  version->metrics = TestMetrics().ForVersion(name, "1");
  version->batcher =
      std::make_unique<Batcher>(name, *version->loaded.engine, options, *version->metrics);
  return version;
}

// A one-sequence query of `tokens` random tokens.
AttentionRequest Query(int64_t tokens, uint32_t seed, std::vector<float>& storage,
                       int64_t embed_dim = kE) {
  storage = RandomVector(tokens * embed_dim, seed);
  RequestInputs in;
  in.query = TensorView{DType::kF32,
                        {1, tokens, embed_dim},
                        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(storage.data()),
                                            storage.size() * sizeof(float)),
                        {}};
  auto request =
      AttentionRequest::Create(MakeDims(embed_dim, 4), in, 1 << 20, DTypeSpelling::kMhaV1);
  EXPECT_TRUE(request.ok()) << request.status();
  return *std::move(request);
}

// A step of `tokens` random tokens for session `id`, read as the server
// reads it: against the version the session is open on.
StepParams MakeStep(SessionManager& sessions, const std::string& id, int64_t tokens, uint32_t seed,
                    std::vector<float>& storage, std::optional<int64_t> expected = std::nullopt) {
  absl::StatusOr<VersionPtr> version = sessions.VersionOf(id);
  return {.id = id,
          .query = Query(tokens, seed, storage),
          .expected_position = expected,
          .decoded_for = version.ok() ? *version : nullptr};
}

std::string OpenSync(SessionManager& sessions, VersionPtr version, absl::Duration idle = {},
                     const std::string& id = "") {
  std::promise<absl::StatusOr<SessionInfo>> opened;
  OpenParams params;
  params.version = std::move(version);
  params.id = id;
  params.idle_timeout = idle;
  sessions.Open(std::move(params),
                [&](absl::StatusOr<SessionInfo> info) { opened.set_value(std::move(info)); });
  absl::StatusOr<SessionInfo> info = opened.get_future().get();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->id : "";
}

// Appends `tokens` tokens; returns the output (empty on error, status set).
std::vector<float> AppendSync(SessionManager& sessions, const std::string& id, int64_t tokens,
                              uint32_t seed, absl::Status* status = nullptr,
                              std::optional<int64_t> expected = std::nullopt) {
  std::vector<float> storage;
  std::promise<absl::StatusOr<std::vector<float>>> done;
  sessions.Step(MakeStep(sessions, id, tokens, seed, storage, expected),
                [&](absl::StatusOr<StepResult> r) {
                  if (!r.ok()) return done.set_value(r.status());
                  done.set_value(std::vector<float>(r->output.begin(), r->output.end()));
                });
  absl::StatusOr<std::vector<float>> out = done.get_future().get();
  if (status != nullptr) *status = out.status();
  return out.ok() ? *out : std::vector<float>{};
}

TEST(SessionManagerTest, ManyThreadsStepTheirOwnSessionsCorrectly) {
  const VersionPtr version = MakeVersion();
  SessionManager sessions({}, {});
  constexpr int kThreads = 6, kSteps = 12;
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = OpenSync(sessions, version);
      // The same steps on a private cache, one engine call each.
      KvBlockPool pool(int64_t{16} << 20);
      KvCache mine(version->loaded.engine->kv_layout(), pool);
      auto ws = version->loaded.engine->NewWorkspace();
      for (int s = 0; s < kSteps; ++s) {
        const int64_t tokens = 1 + (s + t) % 3;
        const uint32_t seed = 100 * t + s;
        const std::vector<float> got = AppendSync(sessions, id, tokens, seed);
        std::vector<float> storage = RandomVector(tokens * kE, seed), want(tokens * kE);
        EXPECT_TRUE(mine.Reserve(mine.length() + tokens).ok());
        EXPECT_TRUE(version->loaded.engine
                        ->Step({storage, {{&mine, tokens}}}, {absl::MakeSpan(want), {}}, *ws)
                        .ok());
        if (got.size() != want.size() || MaxAbsDiff(got.data(), want.data(), want.size()) > 1e-5f) {
          ++mismatches;
        }
        if (s % 4 == 3) sessions.List("");  // readers beside the worker
      }
      EXPECT_TRUE(sessions.Close(id).ok());
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  // A step group lets go of its sessions just after answering: a session
  // closed as its last answer arrives frees its blocks a moment later.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (sessions.pool_bytes_in_use() != 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(sessions.pool_bytes_in_use(), 0) << "closed sessions give their blocks back";
}

TEST(SessionManagerTest, QueuedStepsOfOneSessionRunInOrder) {
  SessionManager sessions({}, {});
  const std::string id = OpenSync(sessions, MakeVersion());
  std::vector<std::vector<float>> storage(3);
  std::vector<std::promise<absl::Status>> done(3);
  for (int i = 0; i < 3; ++i) {  // sent without waiting, each naming its position
    sessions.Step(MakeStep(sessions, id, 2, i, storage[i], int64_t{2 * i}),
                  [&, i](absl::StatusOr<StepResult> r) { done[i].set_value(r.status()); });
  }
  for (auto& d : done) EXPECT_TRUE(d.get_future().get().ok());
  EXPECT_EQ(sessions.List("")[0].position, 6);
}

// A client-chosen id closed and opened again on a wider model between
// reading a step (checked against the first model's width) and queueing
// it: the step must not reach the new session (it would read past its
// query).
TEST(SessionManagerTest, StepReadForAReopenedIdIsRefused) {
  SessionManager sessions({}, {});
  const VersionPtr narrow = MakeVersion(), wide = MakeVersion({}, 2 * kE, "wide");
  const std::string id = OpenSync(sessions, narrow, {}, "mine");
  std::vector<float> storage;
  StepParams step = MakeStep(sessions, id, 3, 1, storage);
  ASSERT_TRUE(sessions.Close(id).ok());
  ASSERT_EQ(OpenSync(sessions, wide, {}, "mine"), "mine");
  std::promise<absl::Status> done;
  sessions.Step(std::move(step), [&](absl::StatusOr<StepResult> r) { done.set_value(r.status()); });
  const absl::Status status = done.get_future().get();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_NE(status.message().find("session mine was closed and opened again (on model 'wide'"),
            std::string::npos)
      << status;
  EXPECT_EQ(sessions.List("")[0].position, 0);
  std::promise<absl::Status> again;  // read again for the new width, it is welcome
  sessions.Step({.id = id, .query = Query(1, 2, storage, 2 * kE), .decoded_for = wide},
                [&](absl::StatusOr<StepResult> r) { again.set_value(r.status()); });
  EXPECT_TRUE(again.get_future().get().ok());
  EXPECT_EQ(sessions.List("")[0].position, 1);
}

// How many times the thread of this process named `name` has slept and
// been woken (its voluntary context switches), or -1 if there is none.
int64_t WakeUpsOfThread(const std::string& name) {
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string found;
    if (!std::getline(comm, found) || found != name) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      absl::string_view rest = line;
      if (absl::ConsumePrefix(&rest, "voluntary_ctxt_switches:"))
        return std::stoll(std::string(rest));
    }
  }
  return -1;
}

// The expiry thread wakes on its tick (1 s) and at Stop, not for each step:
// it used to share the condition variable every step notifies, and was
// woken ~5,000 times a second by 16 stepping sessions, a context switch
// each on the server's cores.
TEST(SessionManagerTest, StepsDoNotWakeTheExpiryThread) {
  SessionManager sessions({}, {});  // the real clock: the tick is a second away
  const std::string id = OpenSync(sessions, MakeVersion());
  const int64_t before = WakeUpsOfThread("mha-expiry");
  ASSERT_GE(before, 0) << "no thread named mha-expiry";
  const absl::Time start = absl::Now();
  for (int i = 0; i < 200; ++i) AppendSync(sessions, id, 1, i);
  const int64_t woken = WakeUpsOfThread("mha-expiry") - before;
  // One tick may fall inside the steps (two if they took over a second).
  EXPECT_LE(woken, 1 + absl::ToInt64Seconds(absl::Now() - start))
      << "200 steps woke the expiry thread " << woken << " times";
}

TEST(SessionManagerTest, IdleSessionsExpireAndSaySo) {
  testing::ManualClock clock;
  SessionOptions options;
  options.clock = &clock;
  SessionManager sessions(options, {});
  const VersionPtr version = MakeVersion();
  const std::string id = OpenSync(sessions, version, absl::Seconds(10));
  AppendSync(sessions, id, 1, 1);
  clock.Advance(absl::Seconds(11));
  absl::Status status;
  AppendSync(sessions, id, 1, 2, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(status.message().find("expired: idle 11 s (idle timeout 10 s)"), std::string::npos)
      << status;
}

// A lookup (a step's decoding, a sequence's next request) finds a session
// idle past its timeout expired at once, not only after the expiry thread's
// next tick, up to a second later (a sequence then said NOT_FOUND from the
// step instead of INVALID_ARGUMENT from its lookup).
TEST(SessionManagerTest, ALookupFindsAnIdleSessionExpiredBeforeTheTick) {
  SessionManager sessions({}, {});  // the real clock: the tick is up to a second away
  const std::string id = OpenSync(sessions, MakeVersion(), absl::Milliseconds(50));
  absl::SleepFor(absl::Milliseconds(60));
  const absl::Status status = sessions.VersionOf(id).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_NE(status.message().find("was expired: idle"), std::string::npos) << status;
}

TEST(SessionManagerTest, FullCacheEvictsLeastRecentlyUsedIdleSession) {
  testing::ManualClock clock;
  SessionOptions options;
  options.clock = &clock;
  const VersionPtr version = MakeVersion();
  options.cache_bytes = 2 * version->loaded.engine->kv_layout().block_bytes();
  SessionManager sessions(options, {});
  const std::string a = OpenSync(sessions, version), b = OpenSync(sessions, version);
  AppendSync(sessions, a, 1, 1);
  clock.Advance(absl::Seconds(3));
  AppendSync(sessions, b, 1, 2);
  const std::string c = OpenSync(sessions, version);
  absl::Status status;
  AppendSync(sessions, c, 1, 3, &status);
  EXPECT_TRUE(status.ok()) << status;
  AppendSync(sessions, a, 1, 4, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(status.message().find("was evicted: idle 3 s, cache full"), std::string::npos)
      << status;
  AppendSync(sessions, b, 1, 5, &status);
  EXPECT_TRUE(status.ok()) << "b was used after a: " << status;
  // A step of the expected position only.
  AppendSync(sessions, b, 1, 6, &status, /*expected=*/0);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
}

// A session closed while its step is answered keeps its blocks until the
// step group lets go of it; the cache gauge must then come down to what
// is left in use.
TEST(SessionManagerTest, CacheGaugeFollowsASessionClosedWhileItsStepIsAnswered) {
  prometheus::Gauge cache_bytes;
  SessionMetrics metrics;
  metrics.cache_bytes = &cache_bytes;
  const VersionPtr version = MakeVersion();  // as the repository holds it
  SessionManager sessions({}, metrics);
  const std::string id = OpenSync(sessions, version);
  AppendSync(sessions, id, 3, 1);
  EXPECT_GT(cache_bytes.Value(), 0);
  std::vector<float> storage;
  std::promise<absl::Status> done;
  sessions.Step(MakeStep(sessions, id, 1, 2, storage), [&](absl::StatusOr<StepResult> r) {
    EXPECT_TRUE(sessions.Close(id).ok());  // the client closes as the answer arrives
    done.set_value(r.status());
  });
  EXPECT_TRUE(done.get_future().get().ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (cache_bytes.Value() != 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(sessions.pool_bytes_in_use(), 0);
  EXPECT_EQ(cache_bytes.Value(), 0);
}

// An Attend request waiting for its batch to fill and a session step go
// to one worker: the step closes the batch at once, goes first in an engine
// call of its own and is answered before the request's call is computed;
// each gets what a call of its own gives.
TEST(SessionManagerTest, AStepIsAnsweredBeforeTheAttendRequestItWasTakenWith) {
  BatcherOptions options;
  options.max_queue_delay = absl::Seconds(30);  // the request would wait alone
  const VersionPtr version = MakeVersion(options);
  const MhaEngine& engine = *version->loaded.engine;
  SessionManager sessions({}, {});
  const std::string id = OpenSync(sessions, version);
  const auto calls = [&] {
    return version->metrics->compute_duration->Collect().histogram.sample_count;
  };
  const uint64_t calls_before = calls();

  std::vector<float> attend_storage;
  std::promise<std::vector<float>> attended;
  version->batcher->Enqueue(
      testing::MakeCall(Query(5, 7, attend_storage), [&](absl::StatusOr<AttentionResult> r) {
        EXPECT_TRUE(r.ok()) << r.status();
        attended.set_value(r.ok() ? std::vector<float>(r->output.begin(), r->output.end())
                                  : std::vector<float>{});
      }));
  std::vector<float> step_storage;
  std::promise<std::vector<float>> step_done;
  uint64_t calls_when_stepped = 0;
  sessions.Step(MakeStep(sessions, id, 2, 8, step_storage), [&](absl::StatusOr<StepResult> r) {
    EXPECT_TRUE(r.ok()) << r.status();
    calls_when_stepped = calls();
    step_done.set_value(r.ok() ? std::vector<float>(r->output.begin(), r->output.end())
                               : std::vector<float>{});
  });
  const std::vector<float> stepped = step_done.get_future().get();
  const std::vector<float> attend_out = attended.get_future().get();
  EXPECT_EQ(calls_when_stepped - calls_before, 1u) << "the request's call had not been computed";
  EXPECT_EQ(calls() - calls_before, 2u) << "the step's call, then the request's";

  auto ws = engine.NewWorkspace();
  std::vector<float> want_attend(5 * kE);
  std::vector<float> unused;
  const AttentionRequest alone = Query(5, 7, unused);
  ASSERT_TRUE(engine.Run(alone.batch(), {absl::MakeSpan(want_attend), {}}, *ws).ok());
  EXPECT_LE(MaxAbsDiff(attend_out.data(), want_attend.data(), want_attend.size()), 1e-5f);
  KvBlockPool pool(int64_t{16} << 20);
  KvCache cache(engine.kv_layout(), pool);
  ASSERT_TRUE(cache.Reserve(2).ok());
  const std::vector<float> q = RandomVector(2 * kE, 8);
  std::vector<float> want_step(2 * kE);
  ASSERT_TRUE(engine.Step({q, {{&cache, 2}}}, {absl::MakeSpan(want_step), {}}, *ws).ok());
  ASSERT_EQ(stepped.size(), want_step.size());
  EXPECT_LE(MaxAbsDiff(stepped.data(), want_step.data(), want_step.size()), 1e-5f);
}

// Stop computes the steps already queued, then refuses new ones.
TEST(SessionManagerTest, StopAnswersQueuedStepsThenRefuses) {
  const VersionPtr version = MakeVersion();
  SessionManager sessions({}, {});
  const std::string id = OpenSync(sessions, version);
  std::vector<std::vector<float>> storage(4);
  std::vector<std::promise<absl::Status>> done(4);
  for (int i = 0; i < 4; ++i) {
    sessions.Step(MakeStep(sessions, id, 1, i, storage[i]),
                  [&, i](absl::StatusOr<StepResult> r) { done[i].set_value(r.status()); });
  }
  sessions.Stop();
  for (auto& d : done) EXPECT_TRUE(d.get_future().get().ok());
  absl::Status after;
  AppendSync(sessions, id, 1, 9, &after);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable);
}

// Appends with `params` changed by `edit` (a deadline, a cancellation).
absl::Status AppendWith(SessionManager& sessions, const std::string& id,
                        const std::function<void(StepParams&)>& edit) {
  std::vector<float> storage;
  StepParams params = MakeStep(sessions, id, 1, 11, storage);
  edit(params);
  std::promise<absl::Status> done;
  sessions.Step(std::move(params),
                [&](absl::StatusOr<StepResult> r) { done.set_value(r.status()); });
  return done.get_future().get();
}

int64_t PositionOf(const SessionManager& sessions, const std::string& id) {
  for (const SessionInfo& info : sessions.List("")) {
    if (info.id == id) return info.position;
  }
  return -1;
}

// A step whose deadline passed, or whose caller cancelled, while it was
// queued is refused and never computed: the session stays where it was,
// and the drop is counted by reason.
TEST(SessionManagerTest, ExpiredAndCancelledStepsAreNeverComputed) {
  testing::ManualClock clock;
  Metrics metrics;
  SessionOptions options;
  options.clock = &clock;
  SessionManager sessions(options, metrics.Sessions());
  BatcherOptions scheduler;  // deadlines are the scheduler's: the same clock
  scheduler.clock = &clock;
  const VersionPtr version = MakeVersion(scheduler);
  const std::string id = OpenSync(sessions, version);
  AppendSync(sessions, id, 2, 1);

  const absl::Status late = AppendWith(
      sessions, id, [&](StepParams& p) { p.deadline = clock.Now() - absl::Milliseconds(1); });
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  const absl::Status gone =
      AppendWith(sessions, id, [](StepParams& p) { p.cancelled = [] { return true; }; });
  EXPECT_EQ(gone.code(), absl::StatusCode::kCancelled) << gone;
  EXPECT_EQ(PositionOf(sessions, id), 2) << "neither step was computed";

  const absl::Status on_time = AppendWith(sessions, id, [&](StepParams& p) {
    p.deadline = clock.Now() + absl::Seconds(10);
    p.cancelled = [] { return false; };
  });
  EXPECT_TRUE(on_time.ok()) << on_time;
  EXPECT_EQ(PositionOf(sessions, id), 3);
  SessionMetrics m = metrics.Sessions();
  for (const std::string reason : {"deadline", "cancelled"}) {
    EXPECT_EQ(m.steps_dropped->Add({{"model", "m"}, {"reason", reason}}).Value(), 1) << reason;
  }
}

// A model version whose batcher takes its memory from `budget`.
VersionPtr VersionOnBudget(MemoryBudget& budget) {
  BatcherOptions options;
  options.memory = &budget;
  return MakeVersion(options);
}

// Expects session `id`'s next one-token step refused for lack of memory,
// saying `why`, and the session left where it was (no token).
void ExpectStepRefusedForMemory(SessionManager& sessions, const std::string& id, const char* why) {
  absl::Status status;
  AppendSync(sessions, id, 1, 1, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find(why), std::string::npos) << status;
  EXPECT_EQ(PositionOf(sessions, id), 0);
}

// Steps take their memory from the budget Attend requests take theirs
// from (their batcher's, the scheduler's one admission path): a step that alone needs more than the
// budget is refused, so is one that finds the budget held; a step that fits gives its memory back
// once it is answered.
TEST(SessionManagerTest, StepsAreAdmittedThroughTheMemoryBudget) {
  const VersionPtr version = MakeVersion();
  std::vector<float> unused;
  const RequestCost cost = CostOfStep(Query(1, 1, unused), /*keys=*/1, *version->loaded.engine,
                                      version->batcher->MaxThreadsPerCall());
  ASSERT_GT(cost.active_bytes, 0);
  ASSERT_GT(cost.queued_bytes, 0);
  Metrics metrics;

  {  // Too large for the whole budget: refused at once.
    MemoryBudget budget(cost.total() - 1);
    const VersionPtr on_budget = VersionOnBudget(budget);
    SessionManager sessions({}, metrics.Sessions());
    const std::string id = OpenSync(sessions, on_budget);
    ExpectStepRefusedForMemory(sessions, id, "the step needs");
  }
  {  // The budget held by queued requests: nothing will give it back.
    MemoryBudget budget(cost.total());
    MemoryReservation queued_request;
    ASSERT_TRUE(budget.TryReserveQueued(cost.active_bytes, queued_request));
    const VersionPtr on_budget = VersionOnBudget(budget);
    SessionManager sessions({}, metrics.Sessions());
    const std::string id = OpenSync(sessions, on_budget);
    ExpectStepRefusedForMemory(sessions, id, "more to compute");
    EXPECT_EQ(budget.reserved(), cost.active_bytes) << "the step gave its queued bytes back";
    queued_request.Release();
    absl::Status status;
    AppendSync(sessions, id, 1, 1, &status);  // room now
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(PositionOf(sessions, id), 1);
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (budget.reserved() != 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_EQ(budget.reserved(), 0) << "the step's reservation comes back after its answer";
  }
  SessionMetrics m = metrics.Sessions();
  EXPECT_EQ(m.steps_dropped->Add({{"model", "m"}, {"reason", "memory"}}).Value(), 2);
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// The outputs of `steps` (tokens, seed) appended one engine call each to a
// private cache: what a session fed the same steps must answer.
std::vector<std::vector<float>> PrivateSteps(
    const ModelVersion& version, const std::vector<std::pair<int64_t, uint32_t>>& steps) {
  KvBlockPool pool(int64_t{16} << 20);
  KvCache cache(version.loaded.engine->kv_layout(), pool);
  auto ws = version.loaded.engine->NewWorkspace();
  std::vector<std::vector<float>> outputs;
  for (const auto& [tokens, seed] : steps) {
    std::vector<float> query = RandomVector(tokens * kE, seed), out(tokens * kE);
    EXPECT_TRUE(cache.Reserve(cache.length() + tokens).ok());
    EXPECT_TRUE(
        version.loaded.engine->Step({query, {{&cache, tokens}}}, {absl::MakeSpan(out), {}}, *ws)
            .ok());
    outputs.push_back(std::move(out));
  }
  return outputs;
}

void ExpectPoolBlocks(const SessionManager& sessions, int64_t blocks, int64_t block_bytes,
                      const char* when) {
  const absl::Time give_up = absl::Now() + absl::Seconds(5);  // step groups let go just after
  while (sessions.pool_bytes_in_use() != blocks * block_bytes && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(sessions.pool_bytes_in_use(), blocks * block_bytes) << when;
}

// A fork shares its parent's blocks: no cache bytes until one of them
// appends into the shared, partly filled block (copied, valid tokens only)
// or beyond; each branch then equals its own sequence computed alone; a
// shared block goes back only with its last session.
void CheckForks(bool bf16, bool int8 = false) {
  const VersionPtr version = MakeVersion({}, kE, "m", bf16, int8);
  const int64_t block = version->loaded.engine->kv_layout().block_bytes();
  SessionManager sessions({}, {});
  for (const int64_t prefix : {40, 64}) {  // a partly filled last block, then a full one
    SCOPED_TRACE(absl::StrCat(bf16 ? "bf16 " : "fp32 ", int8 ? "int8 cache " : "", prefix));
    const std::string parent = OpenSync(sessions, version);
    const std::vector<float> first = AppendSync(sessions, parent, prefix, 7);
    const int64_t prefix_blocks = (prefix + 31) / 32;
    ExpectPoolBlocks(sessions, prefix_blocks, block, "the prefix");
    absl::StatusOr<SessionInfo> child = sessions.Fork(parent, "child");
    ASSERT_TRUE(child.ok()) << child.status();
    EXPECT_EQ(child->position, prefix);
    EXPECT_EQ(child->version, 1);
    ExpectPoolBlocks(sessions, prefix_blocks, block, "a fork takes no block");
    EXPECT_EQ(sessions.Fork(parent, "child").status().code(), absl::StatusCode::kAlreadyExists);

    const std::vector<float> parent_next = AppendSync(sessions, parent, 5, 11);
    const std::vector<float> child_next = AppendSync(sessions, "child", 5, 12);
    const std::vector<float> child_more = AppendSync(sessions, "child", 30, 13);
    // The parent reads its own tail again: the child's steps left it alone.
    const std::vector<float> parent_last = AppendSync(sessions, parent, 1, 14);
    const auto want_parent = PrivateSteps(*version, {{prefix, 7}, {5, 11}, {1, 14}});
    const auto want_child = PrivateSteps(*version, {{prefix, 7}, {5, 12}, {30, 13}});
    EXPECT_LE(MaxAbsDiff(first.data(), want_parent[0].data(), first.size()), 1e-5f);
    ASSERT_EQ(parent_next.size(), want_parent[1].size());
    EXPECT_LE(MaxAbsDiff(parent_next.data(), want_parent[1].data(), parent_next.size()), 1e-5f);
    ASSERT_EQ(parent_last.size(), want_parent[2].size());
    EXPECT_LE(MaxAbsDiff(parent_last.data(), want_parent[2].data(), parent_last.size()), 1e-5f);
    ASSERT_EQ(child_next.size(), want_child[1].size());
    EXPECT_LE(MaxAbsDiff(child_next.data(), want_child[1].data(), child_next.size()), 1e-5f);
    ASSERT_EQ(child_more.size(), want_child[2].size());
    EXPECT_LE(MaxAbsDiff(child_more.data(), want_child[2].data(), child_more.size()), 1e-5f);

    // Full blocks stay shared; each branch holds its own tail.
    const int64_t full = prefix / 32;
    const int64_t parent_own = (prefix + 6 + 31) / 32 - full;
    const int64_t child_own = (prefix + 35 + 31) / 32 - full;
    ExpectPoolBlocks(sessions, full + parent_own + child_own, block, "after both appended");
    absl::StatusOr<SessionInfo> closed = sessions.Close(parent);
    ASSERT_TRUE(closed.ok());
    ExpectPoolBlocks(sessions, full + child_own, block, "the shared blocks stay with the child");
    ASSERT_TRUE(sessions.Close("child").ok());
    ExpectPoolBlocks(sessions, 0, block, "the last session lets go");
  }
  EXPECT_EQ(sessions.Fork("nosuch", "x").status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionManagerTest, ForksShareBlocksCopyOnWriteAndBranchCorrectly) {
  CheckForks(/*bf16=*/false);
  CheckForks(/*bf16=*/true);  // 2-byte elements where the CPU computes in bf16
  // An int8 cache: a copied partial block takes its tokens' scales along
  // (the private sessions round the same rows the same way, so 1e-5 holds).
  CheckForks(/*bf16=*/false, /*int8=*/true);
}

// Eviction frees only blocks no live session needs: idle sessions whose
// blocks a fork shares free nothing, so they are not evicted for room they
// cannot give; once the fork is gone, the parent's blocks are its own again.
TEST(SessionManagerTest, EvictionSkipsSessionsWhoseBlocksAForkShares) {
  testing::ManualClock clock;
  SessionOptions options;
  options.clock = &clock;
  const VersionPtr version = MakeVersion();
  const int64_t block = version->loaded.engine->kv_layout().block_bytes();
  options.cache_bytes = 3 * block;
  SessionManager sessions(options, {});
  const std::string parent = OpenSync(sessions, version, {}, "parent");
  AppendSync(sessions, parent, 64, 1);  // two whole blocks
  ASSERT_TRUE(sessions.Fork(parent, "child").ok());
  ExpectPoolBlocks(sessions, 2, block, "shared");
  clock.Advance(absl::Seconds(5));
  const std::string other = OpenSync(sessions, version, {}, "other");
  absl::Status status;
  AppendSync(sessions, other, 40, 2, &status);  // needs 2 blocks, 1 is free
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("would not make room"), std::string::npos) << status;
  EXPECT_TRUE(sessions.VersionOf(parent).ok()) << "not evicted for nothing";
  EXPECT_TRUE(sessions.VersionOf("child").ok());
  ASSERT_TRUE(sessions.Close("child").ok());
  AppendSync(sessions, other, 40, 2, &status);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(sessions.VersionOf(parent).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mha::server
