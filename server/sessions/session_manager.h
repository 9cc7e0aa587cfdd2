// Sessions: key/value caches that outlive a request, their limits (a byte
// budget, a session count, idle expiry, tokens per session) and eviction:
// a registry and a KV-block allocator. Steps and encoder-memory projections are
// tasks of the model versions' batchers (the scheduler), which ask this
// manager whether a step may start and for its blocks. No gRPC here: the
// service decodes and encodes.
#ifndef MHA_SERVER_SESSIONS_SESSION_MANAGER_H_
#define MHA_SERVER_SESSIONS_SESSION_MANAGER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/kv_cache.h"
#include "engine/mutex.h"
#include "server/models/model_repository.h"
#include "server/observability/metrics.h"
#include "server/scheduling/admission.h"
#include "server/scheduling/batcher.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/memory_budget.h"
#include "server/scheduling/task.h"

namespace mha::server {

struct SessionOptions {
  int64_t cache_bytes = int64_t{512} << 20;  // the block pool's budget
  int64_t max_sessions = 1024;
  absl::Duration idle_timeout = absl::Seconds(60);  // default per session
  int64_t max_tokens = 8192;                        // default and cap per session
  // How long Stop waits for queued steps before refusing them.
  absl::Duration stop_timeout = absl::Seconds(30);
  const Clock* clock = nullptr;  // null: the real clock
};

// A cache's element type as ListSessions, session headers and Triton's
// config spell it: "FP32", "BF16" or "INT8".
const char* CacheDtypeName(const KvLayout& layout);

// What a session is, as OpenSession, Append and ListSessions report it.
struct SessionInfo {
  std::string id, model;
  int64_t version = 0;
  int64_t position = 0;
  int64_t bytes = 0;                 // of the blocks it holds
  int64_t own_bytes = 0;             // of those, the ones no fork shares
  const char* cache_dtype = "FP32";  // of its keys and values: FP32, BF16 or INT8
  int64_t max_tokens = 0;
  bool cross = false;
  absl::Time expires_at;
  absl::Duration idle;
};

// A decoded OpenSession. `memory` (a cross session's encoder memory as the key of
// an AttentionRequest with a one-token dummy query: the request's own
// checks validate it) is absent for a self session.
struct OpenParams {
  VersionPtr version;
  std::string id;  // empty: assigned
  std::optional<AttentionRequest> memory;
  absl::Duration idle_timeout = absl::ZeroDuration();  // zero: the default
  int64_t max_tokens = 0;                              // 0: the default
};

// A decoded step (the Append RPC's): the query as a one-row
// AttentionRequest, checked against the dims of `decoded_for` (the version
// the session was open on when the step was read; Step refuses it if the
// session is no longer on it).
struct StepParams {
  std::string id;
  AttentionRequest query;
  std::optional<int64_t> expected_position = std::nullopt;
  VersionPtr decoded_for = nullptr;
  // As an Attend request's: a step past its deadline or whose caller went
  // away is refused before it is computed.
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled = nullptr;  // may be empty
};

// A session as it leaves (ExportSession, a spill at shutdown): what it is,
// and a fork of its cache at its position, which keeps the blocks alive
// whatever the session does next.
struct SessionSnapshot {
  SessionInfo info;
  VersionPtr version;
  absl::Duration idle_timeout, idle_left;
  std::unique_ptr<KvCache> cache;
};

// A session arriving (ImportSession, a restart): checked against `version`
// by whoever decoded it; `blocks` are `BlocksFor(position)` blocks of the
// version's layout (the valid tokens of each; the rest is ignored).
struct SessionImport {
  VersionPtr version;
  std::string id;
  int64_t position = 0;
  bool cross = false;
  int64_t max_tokens = 0;
  absl::Duration idle_timeout, idle_left;
  std::vector<float> key_padding;  // an encoder memory's, additive; empty: none
  std::vector<std::string> blocks;
};

// A step's results, views valid during the `done` call only.
// The most a session keeps of its last step's answer, for the same step
// sent again (KeptStep): the server reserves --max_sessions of these.
inline constexpr int64_t kKeptAnswerBytesPerSession = int64_t{64} << 10;
struct KeptStep;  // session_internal.h

struct StepResult {
  absl::Span<const float> output;
  absl::Span<const float> weights;  // [tokens, keys] when asked
  int64_t keys = 0;
  int64_t position = 0;
};

// Owns every session (its cache, and a reference to the model version it
// was opened on, which stays alive with it), the block pool and an expiry
// thread. Borrows the metrics. Steps and cross sessions' encoder-memory projections
// are tasks it gives the session's version's batcher, which admits them
// (memory, deadline, cancellation) with the Attend requests, asks here
// whether a step may start (its session free, its position and limits) and
// for its cache blocks (evicting idle sessions when the pool is full), and
// answers them. Every method is thread-safe. Results come through the
// callbacks, on a batcher worker (or at once, in the caller, when refused);
// only Stop waits for compute.
class SessionManager {
 public:
  SessionManager(SessionOptions options, SessionMetrics metrics);
  ~SessionManager();  // Stop()

  using OpenDone = std::function<void(absl::StatusOr<SessionInfo>)>;
  using StepDone = std::function<void(absl::StatusOr<StepResult>)>;

  // A self session opens at once; a cross session's encoder memory is projected on
  // a batcher worker first. ALREADY_EXISTS for an id in use, RESOURCE_EXHAUSTED
  // at --max_sessions or when the memory does not fit, UNAVAILABLE when
  // draining.
  void Open(OpenParams params, OpenDone done);
  // Queues a step. NOT_FOUND for an unknown session says whether it was
  // closed, evicted (and why) or expired; FAILED_PRECONDITION when
  // expected_position is not its position, unless the step is the last one
  // sent again (the same query and options at the position that step
  // expected): then it gets that step's answer again, computing nothing
  // (KeptStep); OUT_OF_RANGE past its max_tokens;
  // RESOURCE_EXHAUSTED when the pool has no room even after evicting idle
  // sessions, or when the memory budget cannot hold the step's query
  // (queued) or, when it is taken, its working memory (a step does not wait
  // for memory behind Attend requests: it is refused at once, like an Attend
  // request that nothing running would make room for); DEADLINE_EXCEEDED
  // and CANCELLED, never computed, when its deadline passed or its caller
  // cancelled while it was queued.
  void Step(StepParams params, StepDone done);
  // A new session `new_id` ("": assigned) at `id`'s position (as of its
  // last finished step), on the same version, sharing its cache blocks
  // copy-on-write: it takes no cache bytes until one of them appends into
  // a shared, partly filled block (that one is copied) or beyond. Each then
  // goes its own way. NOT_FOUND as Step says; FAILED_PRECONDITION while a
  // cross session's encoder memory is being projected; ALREADY_EXISTS,
  // RESOURCE_EXHAUSTED (--max_sessions) and UNAVAILABLE as Open.
  absl::StatusOr<SessionInfo> Fork(const std::string& id, const std::string& new_id);
  // `id` as it is now (its last answered step), to send elsewhere.
  // NOT_FOUND as Step says; FAILED_PRECONDITION while a cross session's
  // encoder memory is being projected.
  absl::StatusOr<SessionSnapshot> Snapshot(const std::string& id);
  // Every open session's id (for a spill).
  std::vector<std::string> Ids() const;
  // Adds a session made elsewhere, whole or not at all: its blocks are
  // reserved (evicting idle sessions as a step would), filled, then it
  // is added. ALREADY_EXISTS, RESOURCE_EXHAUSTED (cache, --max_sessions)
  // and UNAVAILABLE as Open; INVALID_ARGUMENT when the blocks or the
  // padding do not fit the position; OUT_OF_RANGE past --session_max_tokens.
  absl::StatusOr<SessionInfo> Import(SessionImport session);
  // Records why `id` is not here (e.g. it could not come back after a
  // restart), for its next call's NOT_FOUND.
  void MarkGone(const std::string& id, const std::string& why);
  // Frees a session; returns it as it was. Blocks it shares with a fork
  // stay until their last session lets go.
  absl::StatusOr<SessionInfo> Close(const std::string& id);
  // The model version `id` is open on (to decode its steps), or NOT_FOUND
  // as Step says it.
  absl::StatusOr<VersionPtr> VersionOf(const std::string& id);
  // Every session (of `model` when not empty).
  std::vector<SessionInfo> List(const std::string& model) const;

  // No new sessions from now on; steps go on.
  void StartDraining();
  // Refuses new calls, waits (up to stop_timeout) for the batchers to
  // compute the queued steps, has them refuse what is left, and joins the
  // expiry thread. The batchers must still run.
  void Stop();

  int64_t pool_bytes_in_use() const { return pool_.bytes_in_use(); }
  // What the cache holds: blocks in use and kept for reuse
  // (mha_memory_held_bytes{kind="kv_cache"}).
  int64_t pool_bytes_held() const { return pool_.bytes_held(); }
  // The answers the sessions keep for a step sent again (at most
  // KeptStep::kKeptAnswerBytes a session; kind="session_answers").
  int64_t kept_answer_bytes() const { return kept_answer_bytes_.load(); }
  int64_t cache_budget() const { return pool_.budget(); }

 private:
  struct Session;
  class StepCall;
  class EncoderProjection;
  using SessionPtr = std::shared_ptr<Session>;

  void ExpiryLoop();
  // What a step costs at its session's position now (mu_ held).
  RequestCost CostLocked(const Session& s, const AttentionRequest& query) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step's life as its batcher asks (StepTask): whether it may start
  // (its session free, open, at the expected position, within max_tokens),
  // its blocks, back to waiting, answered.
  StepTask::Start BeginStep(StepCall& step, StepPlan& plan, absl::Status& why);
  absl::Status AllocateStep(StepCall& step);
  void AbandonStep(StepCall& step);
  void FinishStep(StepCall& step, const absl::Status& status, absl::Span<const float> output,
                  absl::Span<const float> weights);
  void FailStep(StepCall& step, const absl::Status& status);
  // Answers a step that repeats its session's last one with that step's
  // kept answer (BeginStep found it).
  void AnswerAgain(StepCall& step);
  // Why `step` may not start at `s`'s position (FAILED_PRECONDITION), or OK
  // when it is `s`'s last step sent again (then its kept answer is set).
  absl::Status NotAtExpectedLocked(const Session& s, StepCall& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A finished self step as its session's last will keep it (KeptStep).
  KeptStep KeepLastStep(StepCall& step, const StepResult& result);
  void CountDropped(const std::string& model, const char* reason);
  // A task of this manager ends (Stop waits for every one).
  void TaskGone();
  void RunOpen(EncoderProjection& open, Workspace& ws);
  void FailOpen(EncoderProjection& open, const absl::Status& status);
  // Makes room for `tokens` in `session`'s cache, evicting idle sessions
  // least recently used first. With mu_ held.
  absl::Status ReserveLocked(Session& session, int64_t tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a session `id` cannot be added now (draining, --max_sessions, the id
  // taken); an empty id is never taken.
  absl::Status CanAddLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `params` cannot open a session now (CanAddLocked, the model, limits).
  absl::Status CanOpenLocked(const OpenParams& params) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `s` is still the open session of its id (not closed, evicted,
  // or replaced by a new session of the same id).
  bool IsOpenLocked(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Open session `id` once its encoder memory is projected, to be copied
  // (fork, snapshot); idle sessions expire first. NOT_FOUND, or
  // FAILED_PRECONDITION "still projecting its memory" + `advice`.
  absl::StatusOr<const Session*> ProjectedSessionLocked(const std::string& id,
                                                        absl::string_view advice)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `id` is not open (closed, evicted, expired) as NOT_FOUND.
  absl::Status NotFoundLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ABORTED: a step read for another version of the session's id.
  absl::Status ReopenedLocked(const Session& session) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `id` by value: it may be the removed session's own.
  void RemoveLocked(std::string id, const std::string& reason, const std::string& metric_reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberGoneLocked(const std::string& id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends session `id` if it has been idle past its timeout, as the expiry
  // thread would at its next tick: a step or a lookup then finds it expired
  // whenever the tick comes, at the cost of one session, not all of them.
  void ExpireIfIdleLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionInfo InfoLocked(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishCacheBytes();  // PublishLocked under the lock

  const SessionOptions options_;
  const SessionMetrics metrics_;
  const Clock& clock_;
  KvBlockPool pool_;
  std::atomic<int64_t> kept_answer_bytes_{0};  // before the sessions that count in it

  mutable Mutex mu_;
  CondVar cv_;         // tasks_ fell (Stop waits for none)
  CondVar expiry_cv_;  // stopping_ set: the expiry thread wakes only for that and its tick
  std::map<std::string, SessionPtr> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> gone_ ABSL_GUARDED_BY(mu_);  // id -> why
  std::deque<std::string> gone_order_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> active_per_model_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Set by Stop once its wait is over: steps still queued are refused.
  bool refusing_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t id_counter_ ABSL_GUARDED_BY(mu_) = 0;
  // Steps and encoder-memory projections given to a batcher and not yet destroyed.
  int64_t tasks_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread expiry_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SESSIONS_SESSION_MANAGER_H_
