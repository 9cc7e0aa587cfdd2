#include "server/sessions/session_manager.h"
#include "server/sessions/session_internal.h"

#include <algorithm>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/mha_engine.h"

namespace mha::server {
namespace {

// Ids of closed, evicted and expired sessions remembered, so a client is
// told what happened to its session.
constexpr size_t kRememberedGone = 4096;
// How often the expiry thread looks for expired sessions.
constexpr absl::Duration kExpiryTick = absl::Seconds(1);

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.0f s", absl::ToDoubleSeconds(d));
}

// What a step of `tokens` attends to: the session's cached keys after it
// (a cross session's memory does not grow) and the model's extra keys.
int64_t StepKeys(const MhaEngine& engine, int64_t position, int64_t tokens, bool cross) {
  return position + (cross ? 0 : tokens) + engine.dims().extra_keys();
}

}  // namespace


struct SessionManager::PendingOpen {
  OpenParams params;
  OpenDone done;
  SessionPtr session;
};

struct SessionManager::PendingStep {
  explicit PendingStep(AppendParams p) : params(std::move(p)) {}
  AppendParams params;
  AppendDone done;
  SessionPtr session;
  absl::Time enqueued;
  // Its query's bytes while queued, and its working memory once taken;
  // given back when the step is answered and destroyed.
  MemoryReservation memory;
  int64_t tokens() const { return params.query.q_len(); }
};

// One engine call's steps as a batcher carries them: their queries back to
// back, and each session's position after the step. Finish settles the
// sessions once and answers each step once, also when it is called again
// after an answer threw (the batcher then finishes the rest with an error).
class SessionManager::Steps : public StepGroup {
 public:
  // Takes `steps` only once the copies are made: if they throw, the caller
  // still has them.
  Steps(SessionManager& manager, std::vector<std::unique_ptr<PendingStep>>&& steps)
      : manager_(manager) {
    for (const auto& step : steps) {  // the sessions are busy: their caches are ours
      const absl::Span<const float> q = step->params.query.batch().query;
      query_.insert(query_.end(), q.begin(), q.end());
      KvCache* cache = step->session->cache.get();
      batch_.steps.push_back({cache, step->tokens(), step->session->cross});
      positions_.push_back(cache->length() + (step->session->cross ? 0 : step->tokens()));
      weights_ |= step->params.query.need_weights();
    }
    batch_.query = query_;
    steps_ = std::move(steps);
  }
  // A session closed while its step computed frees its blocks only here.
  ~Steps() override {
    steps_.clear();
    manager_.PublishCacheBytes();
  }

  const AppendBatch& batch() const override { return batch_; }
  bool need_weights() const override { return weights_; }
  void Finish(const absl::Status& status, absl::Span<const float> output,
              absl::Span<const float> weights) override {
    if (!settled_) {
      settled_ = true;
      manager_.SettleSteps(steps_, status);
    }
    manager_.AnswerSteps(steps_, positions_, status, output, weights, answered_);
  }

 private:
  SessionManager& manager_;
  std::vector<std::unique_ptr<PendingStep>> steps_;
  std::vector<float> query_;
  AppendBatch batch_;
  std::vector<int64_t> positions_;  // after the step
  bool weights_ = false;
  bool settled_ = false;
  size_t answered_ = 0;
};

SessionManager::SessionManager(SessionOptions options, SessionMetrics metrics)
    : options_(options),
      metrics_(metrics),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      pool_(options.cache_bytes) {
  expiry_ = std::thread([this] { ExpiryLoop(); });
}

SessionManager::~SessionManager() { Stop(); }

void SessionManager::StartDraining() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
}

void SessionManager::Stop() {
  std::vector<std::unique_ptr<PendingStep>> left;
  std::vector<VersionPtr> attached;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_ && !expiry_.joinable()) return;
    stopping_ = true;
    // The batchers compute what is queued; a step group or a memory
    // projection they hold is always finished (it points back here).
    cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.stop_timeout),
                 [this] { return steps_.empty(); });
    for (auto& step : steps_) {
      --step->session->queued;
      left.push_back(std::move(step));
    }
    steps_.clear();
    cv_.wait(lock, [this] { return in_flight_ == 0; });
    for (const auto& [key, version] : attached_) {
      if (VersionPtr v = version.lock()) attached.push_back(std::move(v));
    }
    attached_.clear();
  }
  cv_.notify_all();
  for (auto& step : left) {
    step->memory.Release();
    step->done(absl::UnavailableError("the server is shutting down"));
  }
  if (expiry_.joinable()) expiry_.join();
  for (const VersionPtr& v : attached) v->batcher->SetStepSource(nullptr);
}

bool SessionManager::Attach(const VersionPtr& version) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = attached_.begin(); it != attached_.end();) {
      it = it->second.expired() ? attached_.erase(it) : std::next(it);
    }
    if (stopping_) return false;
    if (attached_.count(version.get()) != 0) return true;
  }
  // Not under mu_: SetStepSource waits for the batcher's step groups,
  // which finish under mu_.
  version->batcher->SetStepSource(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      attached_[version.get()] = version;
      return true;
    }
  }
  version->batcher->SetStepSource(nullptr);  // Stop came first: it will not detach us
  return false;
}

std::string SessionManager::NewIdLocked() {
  static thread_local std::mt19937_64 random{std::random_device{}()};
  std::string id;
  do {
    id = absl::StrFormat("%016x", random() ^ ++id_counter_);
  } while (sessions_.count(id) != 0);
  return id;
}

SessionInfo SessionManager::InfoLocked(const Session& s) const {
  const absl::Time now = clock_.Now();
  SessionInfo info;
  info.id = s.id;
  info.model = s.version->name;
  info.version = s.version->version;
  info.position = s.position;
  info.bytes = s.cache->bytes();
  info.own_bytes = s.cache->exclusive_bytes();
  info.cache_dtype = s.cache->layout().elem_bytes == 2 ? "BF16" : "FP32";
  info.max_tokens = s.max_tokens;
  info.cross = s.cross;
  info.expires_at = s.last_used + s.idle_timeout;
  info.idle = now - s.last_used;
  return info;
}

void SessionManager::PublishCacheBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  PublishLocked();
}

void SessionManager::PublishLocked() {
  if (metrics_.cache_bytes != nullptr) {
    metrics_.cache_bytes->Set(static_cast<double>(pool_.bytes_in_use()));
  }
  if (metrics_.active != nullptr) {
    for (const auto& [model, count] : active_per_model_) {
      metrics_.active->Add({{"model", model}}).Set(static_cast<double>(count));
    }
  }
}

void SessionManager::Open(OpenParams params, OpenDone done) {
  const bool attached = Attach(params.version);
  std::unique_lock<std::mutex> lock(mu_);
  auto refuse = [&](absl::Status status) {
    lock.unlock();
    done(std::move(status));
  };
  if (draining_ || stopping_ || !attached) {
    return refuse(absl::UnavailableError("the server is shutting down: no new sessions"));
  }
  const MhaEngine& engine = *params.version->model.engine;
  const bool cross = params.memory.has_value();
  if (!cross && !engine.CanAppendSelf()) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "model ", params.version->name, " has kdim or vdim != embed_dim: it opens only "
        "cross-attention sessions (send a memory; a sequence's start sends a key)")));
  }
  if (params.max_tokens > options_.max_tokens) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("max_tokens ", params.max_tokens, " exceeds the server's limit of ",
                     options_.max_tokens, " (--session_max_tokens)")));
  }
  if (!params.id.empty() && sessions_.count(params.id) != 0) {
    return refuse(absl::AlreadyExistsError(absl::StrCat("session ", params.id, " is open")));
  }
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        options_.max_sessions, " sessions are open (--max_sessions): close one first")));
  }
  auto session = std::make_shared<Session>();
  session->id = params.id.empty() ? NewIdLocked() : params.id;
  session->version = params.version;
  session->cache = std::make_unique<KvCache>(engine.kv_layout(), pool_);
  session->cross = cross;
  session->max_tokens = params.max_tokens > 0 ? params.max_tokens : options_.max_tokens;
  session->idle_timeout = params.idle_timeout > absl::ZeroDuration() ? params.idle_timeout
                                                                    : options_.idle_timeout;
  session->last_used = clock_.Now();
  if (cross) {
    if (absl::Status room = ReserveLocked(*session, params.memory->kv_len()); !room.ok()) {
      return refuse(std::move(room));
    }
    session->busy = true;  // until its memory is projected
  }
  gone_.erase(session->id);
  sessions_[session->id] = session;
  ++active_per_model_[session->version->name];
  PublishLocked();
  if (cross) {  // its memory is projected on a worker of its version's batcher
    auto open = std::make_shared<PendingOpen>();
    open->params = std::move(params);
    open->done = std::move(done);
    open->session = session;
    ++in_flight_;
    lock.unlock();
    const VersionPtr& version = open->params.version;
    absl::Status queued = absl::UnavailableError("the server is shutting down: no new sessions");
    try {
      if (version->batcher->RunOnWorker([this, open](Workspace& ws) { RunOpen(*open, ws); })) {
        return;
      }
    } catch (const std::bad_alloc&) {
      queued = absl::ResourceExhaustedError("out of memory opening the session; retry later");
    }
    lock.lock();
    --in_flight_;
    if (IsOpenLocked(*session)) {
      RemoveLocked(session->id, absl::StrCat("not opened: ", queued.message()), "");
    }
    lock.unlock();
    cv_.notify_all();
    open->done(queued);
    return;
  }
  const SessionInfo info = InfoLocked(*session);
  lock.unlock();
  done(info);
}

void SessionManager::Append(AppendParams params, AppendDone done) {
  std::unique_lock<std::mutex> lock(mu_);
  auto refuse = [&](absl::Status status) {
    lock.unlock();
    done(std::move(status));
  };
  if (stopping_) return refuse(absl::UnavailableError("the server is shutting down"));
  ExpireIdleLocked();
  auto it = sessions_.find(params.id);
  if (it == sessions_.end() || it->second->version != params.decoded_for) {
    return refuse(it == sessions_.end() ? NotFoundLocked(params.id)
                                        : ReopenedLocked(*it->second));
  }
  auto step = std::make_unique<PendingStep>(std::move(params));
  step->session = it->second;
  if (absl::Status admitted = AdmitQueuedLocked(*step); !admitted.ok()) {
    return refuse(std::move(admitted));
  }
  step->enqueued = clock_.Now();
  step->done = std::move(done);
  ++step->session->queued;
  // Once unlocked the step may be refused and its session closed: this
  // reference keeps the batcher alive (the repository holds the version
  // too, so it is never the last one).
  const VersionPtr version = step->session->version;
  steps_.push_back(std::move(step));
  lock.unlock();
  version->batcher->StepsQueued();
}

RequestCost SessionManager::CostLocked(const PendingStep& step) const {
  const Session& s = *step.session;
  const MhaEngine& engine = *s.version->model.engine;
  return CostOfStep(step.params.query, StepKeys(engine, s.position, step.tokens(), s.cross),
                    engine, s.version->batcher->ThreadsPerCall());
}

absl::Status SessionManager::AdmitQueuedLocked(PendingStep& step) {
  MemoryBudget* memory = options_.memory;
  if (memory == nullptr) return absl::OkStatus();
  const RequestCost cost = CostLocked(step);
  absl::Status status = CheckStepMemory(cost, memory->capacity());
  if (status.ok() && !memory->TryReserveQueued(cost.queued_bytes, step.memory)) {
    status = absl::ResourceExhaustedError(absl::StrCat(
        "server memory budget full: requests in flight hold ", WithCommas(memory->reserved()),
        " of ", WithCommas(memory->capacity()), " bytes and this step needs ",
        WithCommas(cost.queued_bytes), " to wait in the queue; retry later"));
  }
  if (!status.ok()) CountDroppedLocked(*step.session, "memory");
  return status;
}

void SessionManager::CountDroppedLocked(const Session& session, const std::string& reason) {
  if (metrics_.steps_dropped == nullptr) return;
  metrics_.steps_dropped->Add({{"model", session.version->name}, {"reason", reason}}).Increment();
}

absl::Status SessionManager::UnwantedLocked(const PendingStep& step) {
  const AppendParams& p = step.params;
  if (p.cancelled && p.cancelled()) {
    CountDroppedLocked(*step.session, "cancelled");
    return absl::CancelledError("client cancelled the request");
  }
  if (clock_.Now() > p.deadline) {
    CountDroppedLocked(*step.session, "deadline");
    return absl::DeadlineExceededError("deadline passed while the step was queued");
  }
  return absl::OkStatus();
}

absl::Status SessionManager::AdmitActiveLocked(PendingStep& step, bool batch_empty, bool& room) {
  room = true;
  MemoryBudget* memory = options_.memory;
  if (memory == nullptr) return absl::OkStatus();
  const RequestCost cost = CostLocked(step);
  if (absl::Status fits = CheckStepMemory(cost, memory->capacity()); !fits.ok()) {
    CountDroppedLocked(*step.session, "memory");
    return fits;
  }
  if (memory->TryGrowActive(cost.active_bytes, step.memory) == MemoryBudget::Growth::kGrown) {
    return absl::OkStatus();
  }
  if (!batch_empty) {  // it may fit once the steps of this call are done
    room = false;
    return absl::OkStatus();
  }
  CountDroppedLocked(*step.session, "memory");
  return absl::ResourceExhaustedError(absl::StrCat(
      "server memory budget full: requests in flight hold ", WithCommas(memory->reserved()),
      " of ", WithCommas(memory->capacity()), " bytes and this step needs ",
      WithCommas(cost.active_bytes), " more to compute; retry later"));
}

absl::Status SessionManager::ReopenedLocked(const Session& session) const {
  // A client-chosen id closed and opened again, maybe on a model of
  // another width, between reading the step and queueing it.
  return absl::AbortedError(absl::StrCat(
      "session ", session.id, " was closed and opened again (on model '", session.version->name,
      "' version ", session.version->version, ") while this step was read; send it again"));
}

absl::StatusOr<SessionInfo> SessionManager::Fork(const std::string& id,
                                                 const std::string& new_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_ || stopping_) {
    return absl::UnavailableError("the server is shutting down: no new sessions");
  }
  ExpireIdleLocked();
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  const Session& parent = *it->second;
  if (parent.cross && parent.position == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " is still projecting its memory: fork it once open"));
  }
  if (!new_id.empty() && sessions_.count(new_id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("session ", new_id, " is open"));
  }
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        options_.max_sessions, " sessions are open (--max_sessions): close one first"));
  }
  auto fork = std::make_shared<Session>();
  fork->id = new_id.empty() ? NewIdLocked() : new_id;
  fork->version = parent.version;
  // The parent's position, not its cache's length: a step of the parent
  // may be writing past it right now.
  fork->cache = parent.cache->Fork(parent.position);
  fork->cross = parent.cross;
  fork->max_tokens = parent.max_tokens;
  fork->idle_timeout = parent.idle_timeout;
  fork->last_used = clock_.Now();
  fork->position = parent.position;
  gone_.erase(fork->id);
  sessions_[fork->id] = fork;
  ++active_per_model_[fork->version->name];
  PublishLocked();
  return InfoLocked(*fork);
}

absl::StatusOr<SessionInfo> SessionManager::Close(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireIdleLocked();
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  SessionInfo info = InfoLocked(*it->second);
  RemoveLocked(id, "closed", "");
  return info;
}

absl::StatusOr<VersionPtr> SessionManager::VersionOf(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  return it->second->version;
}

std::vector<SessionInfo> SessionManager::List(const std::string& model) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionInfo> out;
  for (const auto& [id, session] : sessions_) {
    if (model.empty() || session->version->name == model) out.push_back(InfoLocked(*session));
  }
  return out;
}

bool SessionManager::IsOpenLocked(const Session& s) const {
  auto it = sessions_.find(s.id);
  return it != sessions_.end() && it->second.get() == &s;
}

absl::Status SessionManager::NotFoundLocked(const std::string& id) const {
  auto gone = gone_.find(id);
  if (gone != gone_.end()) {
    return absl::NotFoundError(absl::StrCat("session ", id, " was ", gone->second));
  }
  return absl::NotFoundError(absl::StrCat("session ", id, " is not open"));
}

void SessionManager::RemoveLocked(std::string id, const std::string& reason,
                                  const std::string& metric_reason) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const std::string model = it->second->version->name;
  if (--active_per_model_[model] == 0 && metrics_.active != nullptr) {
    metrics_.active->Add({{"model", model}}).Set(0);
  }
  if (!metric_reason.empty() && metrics_.evictions != nullptr) {
    metrics_.evictions->Add({{"model", model}, {"reason", metric_reason}}).Increment();
  }
  sessions_.erase(it);  // the cache's blocks go back unless a step still runs
  RememberGoneLocked(id, reason);
  PublishLocked();
}

void SessionManager::RememberGoneLocked(const std::string& id, const std::string& why) {
  if (gone_.emplace(id, why).second) gone_order_.push_back(id);
  while (gone_order_.size() > kRememberedGone) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
}

void SessionManager::ExpireIdleLocked() {
  const absl::Time now = clock_.Now();
  std::vector<std::pair<std::string, std::string>> expired;
  for (const auto& [id, s] : sessions_) {
    const absl::Duration idle = now - s->last_used;
    if (!s->busy && s->queued == 0 && idle >= s->idle_timeout) {
      expired.emplace_back(id, absl::StrCat("expired: idle ", Seconds(idle), " (idle timeout ",
                                            Seconds(s->idle_timeout), ")"));
    }
  }
  for (const auto& [id, why] : expired) RemoveLocked(id, why, "expired");
}

absl::Status SessionManager::ReserveLocked(Session& session, int64_t tokens) {
  absl::Status status = session.cache->Reserve(tokens);
  if (status.ok()) return status;
  std::vector<Session*> idle;
  for (const auto& [id, s] : sessions_) {
    if (s.get() != &session && !s->busy && s->queued == 0) idle.push_back(s.get());
  }
  // Evict nobody when even all of them would not make room. Blocks shared
  // with a fork come back only with their last session: an idle session
  // frees its own blocks alone, and one that frees nothing is not evicted.
  idle.erase(std::remove_if(idle.begin(), idle.end(),
                            [](const Session* s) { return s->cache->exclusive_bytes() == 0; }),
             idle.end());
  const KvLayout& layout = session.cache->layout();
  int64_t room = pool_.budget() - pool_.bytes_in_use();
  for (const Session* s : idle) room += s->cache->exclusive_bytes();
  if (room < session.cache->BlocksToReserve(tokens) * layout.block_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        status.message(), "; evicting every idle session would not make room "
        "(--session_cache_bytes)"));
  }
  std::sort(idle.begin(), idle.end(),
            [](const Session* a, const Session* b) { return a->last_used < b->last_used; });
  const absl::Time now = clock_.Now();
  for (Session* victim : idle) {
    const std::string why =
        absl::StrCat("evicted: idle ", Seconds(now - victim->last_used), ", cache full");
    RemoveLocked(victim->id, why, "cache_full");
    status = session.cache->Reserve(tokens);
    if (status.ok()) return status;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat(status.message(), "; no idle session left to evict (--session_cache_bytes)"));
}

void SessionManager::ExpiryLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    clock_.WaitUntil(cv_, lock, clock_.Now() + kExpiryTick);
    ExpireIdleLocked();
  }
}

void SessionManager::RunOpen(PendingOpen& open, Workspace& ws) {
  Session& s = *open.session;
  const AttentionBatch& memory = open.params.memory->batch();
  const absl::Status projected = s.version->model.engine->ProjectMemory(
      memory.key, memory.value, open.params.memory->kv_len(), memory.key_padding_mask,
      *s.cache, ws);
  MhaEngine::ReleaseLargeWorkspace(ws);
  std::unique_lock<std::mutex> lock(mu_);
  s.busy = false;
  s.last_used = clock_.Now();
  s.position = s.cache->length();
  --in_flight_;
  cv_.notify_all();
  // Steps sent before the open answered wait for it: they run now, or are
  // refused (NOT_FOUND, saying why) when it failed.
  const bool queued = HasStepsLocked(*s.version->model.engine);
  if (!projected.ok()) {
    if (IsOpenLocked(s)) RemoveLocked(s.id, absl::StrCat("not opened: ", projected.message()), "");
    lock.unlock();
    if (queued) s.version->batcher->StepsQueued();
    open.done(projected);
    return;
  }
  const SessionInfo info = InfoLocked(s);
  PublishLocked();
  lock.unlock();
  if (queued) s.version->batcher->StepsQueued();
  open.done(info);
}

std::unique_ptr<StepGroup> SessionManager::TakeSteps(const MhaEngine& engine,
                                                     int64_t max_tokens) {
  std::vector<std::function<void()>> refusals;
  std::vector<std::unique_ptr<PendingStep>> steps;
  bool more = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    steps = NextStepsLocked(engine, max_tokens, refusals, more);
    if (!steps.empty()) ++in_flight_;
  }
  if (!refusals.empty()) cv_.notify_all();  // Stop waits for the queue to empty
  for (auto& refuse : refusals) refuse();
  if (steps.empty()) return nullptr;
  if (more) steps.front()->session->version->batcher->StepsQueued();
  try {
    return std::make_unique<Steps>(*this, std::move(steps));
  } catch (const std::bad_alloc&) {  // `steps` is still ours
    const absl::Status status =
        absl::ResourceExhaustedError("out of memory while computing this step; retry later");
    SettleSteps(steps, status);
    size_t answered = 0;
    AnswerSteps(steps, {}, status, {}, {}, answered);
    return nullptr;
  }
}

bool SessionManager::HasStepsLocked(const MhaEngine& engine) const {
  return std::any_of(steps_.begin(), steps_.end(), [&](const auto& step) {
    return step->session->version->model.engine.get() == &engine;
  });
}

std::vector<std::unique_ptr<SessionManager::PendingStep>> SessionManager::NextStepsLocked(
    const MhaEngine& engine, int64_t max_tokens, std::vector<std::function<void()>>& refusals,
    bool& more) {
  ExpireIdleLocked();
  std::vector<std::unique_ptr<PendingStep>> batch;
  std::set<const Session*> taken;  // in the batch, or with an earlier step left queued
  int64_t tokens = 0;
  auto refuse = [&](std::unique_ptr<PendingStep> step, absl::Status status) {
    --step->session->queued;
    if (options_.memory != nullptr) options_.memory->MarkLeaving(step->memory);
    refusals.push_back([step = std::shared_ptr<PendingStep>(std::move(step)), status] {
      step->memory.Release();  // before the answer: the caller may send again at once
      step->done(status);
    });
  };
  for (auto it = steps_.begin(); it != steps_.end();) {
    Session& s = *(*it)->session;
    if (!IsOpenLocked(s)) {  // closed or evicted meanwhile
      absl::Status missing = NotFoundLocked(s.id);
      refuse(std::move(*it), std::move(missing));
      it = steps_.erase(it);
      continue;
    }
    if (s.version->model.engine.get() != &engine) {  // another batcher's
      ++it;
      continue;
    }
    if (absl::Status unwanted = UnwantedLocked(**it); !unwanted.ok()) {
      refuse(std::move(*it), std::move(unwanted));
      it = steps_.erase(it);
      continue;
    }
    const int64_t t = (*it)->tokens();
    const bool fits = batch.empty() || tokens + t <= max_tokens;
    if (taken.count(&s) != 0 || s.busy || !fits) {
      more |= !fits && taken.count(&s) == 0 && !s.busy;
      taken.insert(&s);  // its later steps wait behind this one
      ++it;
      continue;
    }
    const int64_t position = s.position;
    const std::optional<int64_t>& expected = (*it)->params.expected_position;
    absl::Status status;
    if (expected.has_value() && *expected != position) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "session ", s.id, " is at position ", position, ", not at expected_position ",
          *expected));
    } else if (!s.cross && position + t > s.max_tokens) {
      status = absl::OutOfRangeError(absl::StrCat("session ", s.id, " holds ", position,
                                                  " tokens; ", t, " more would pass its max_tokens ",
                                                  s.max_tokens));
    } else {
      bool room = true;
      status = AdmitActiveLocked(**it, batch.empty(), room);
      if (status.ok() && !room) {  // waits for the next call
        more = true;
        taken.insert(&s);
        ++it;
        continue;
      }
      if (status.ok() && !s.cross) status = ReserveLocked(s, position + t);
    }
    if (!status.ok()) {
      refuse(std::move(*it), std::move(status));
      it = steps_.erase(it);
      continue;
    }
    s.busy = true;
    --s.queued;
    taken.insert(&s);
    tokens += t;
    batch.push_back(std::move(*it));
    it = steps_.erase(it);
  }
  return batch;
}

void SessionManager::SettleSteps(const std::vector<std::unique_ptr<PendingStep>>& steps,
                                 const absl::Status& status) {
  const VersionPtr version = steps.front()->session->version;
  const MhaEngine& engine = *version->model.engine;
  const absl::Time now = clock_.Now();
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // First what cannot throw: the sessions are free again, the group done.
    for (const auto& step : steps) {
      Session& s = *step->session;
      s.busy = false;
      s.last_used = now;
      s.position = s.cache->length();
    }
    --in_flight_;
    queued = HasStepsLocked(engine);
    if (!status.ok()) {  // a failed step leaves its cache unknown
      for (const auto& step : steps) {
        Session& s = *step->session;
        if (IsOpenLocked(s)) {
          RemoveLocked(s.id, absl::StrCat("failed: ", status.message()), "failed");
        }
      }
    }
    PublishLocked();
  }
  cv_.notify_all();
  if (queued) version->batcher->StepsQueued();
}

void SessionManager::AnswerSteps(const std::vector<std::unique_ptr<PendingStep>>& steps,
                                 const std::vector<int64_t>& positions,
                                 const absl::Status& status, absl::Span<const float> output,
                                 absl::Span<const float> attn, size_t& answered) {
  const MhaEngine& engine = *steps.front()->session->version->model.engine;
  const int64_t e = engine.dims().embed_dim, extra = engine.dims().extra_keys();
  const absl::Time now = clock_.Now();
  int64_t row = 0, w_off = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    PendingStep& step = *steps[i];
    const int64_t t = step.tokens();
    const int64_t keys = status.ok() ? positions[i] + extra : 0;
    if (i >= answered) {
      if (status.ok()) {
        AppendResult result;
        result.output = output.subspan(row * e, t * e);
        if (step.params.query.need_weights()) result.weights = attn.subspan(w_off, t * keys);
        result.keys = keys;
        result.position = positions[i];
        if (metrics_.append_tokens != nullptr) {
          metrics_.append_tokens->Increment(static_cast<double>(t));
        }
        if (metrics_.append_duration != nullptr) {
          metrics_.append_duration->Observe(absl::ToDoubleSeconds(now - step.enqueued));
        }
        step.done(result);
      } else {
        step.done(status);
      }
      answered = i + 1;
    }
    row += t;
    w_off += attn.empty() ? 0 : t * keys;
  }
}

}  // namespace mha::server
