#include "server/sessions/session_manager.h"

#include <pthread.h>

#include <algorithm>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/mha_engine.h"
#include "engine/too_large.h"
#include "server/scheduling/admission.h"
#include "server/sessions/session_internal.h"

namespace mha::server {

const char* CacheDtypeName(const KvLayout& layout) {
  return layout.int8() ? "INT8" : layout.elem_bytes == 2 ? "BF16" : "FP32";
}

namespace {

// Ids of closed, evicted and expired sessions remembered, so a client is
// told what happened to its session.
constexpr size_t kRememberedGone = 4096;
// How often the expiry thread looks for expired sessions.
constexpr absl::Duration kExpiryTick = absl::Seconds(1);

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.0f s", absl::ToDoubleSeconds(d));
}

}  // namespace

SessionManager::SessionManager(SessionOptions options, SessionMetrics metrics)
    : options_(options),
      metrics_(metrics),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      pool_(options.cache_bytes) {
  expiry_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "mha-expiry");  // as perf and /proc show it
    ExpiryLoop();
  });
}

SessionManager::~SessionManager() { Stop(); }

void SessionManager::StartDraining() {
  MutexLock lock(mu_);
  draining_ = true;
}

void SessionManager::Stop() {
  {
    MutexLock lock(mu_);
    if (stopping_ && !expiry_.joinable()) return;
    stopping_ = true;
    // The batchers compute what is queued, then refuse what is left; a
    // task they hold always ends (it points back here).
    const absl::Time give_up = absl::Now() + options_.stop_timeout;
    while (tasks_ != 0 && absl::Now() < give_up) cv_.WaitUntil(lock, give_up);
    refusing_ = true;
    std::set<const ModelVersion*> seen;
    std::vector<VersionPtr> waiting;  // versions whose batchers hold steps
    for (const auto& [id, s] : sessions_) {
      if (s->queued > 0 && seen.insert(s->version.get()).second) waiting.push_back(s->version);
    }
    lock.Unlock();
    for (const VersionPtr& v : waiting) v->batcher->WakeSteps();  // they refuse them now
    lock.Lock();
    while (tasks_ != 0) cv_.Wait(lock);
  }
  expiry_cv_.NotifyAll();
  if (expiry_.joinable()) expiry_.join();
}

void SessionManager::TaskGone() {
  // Notified under the lock: once Stop sees no task, it may return and the
  // manager go.
  MutexLock lock(mu_);
  --tasks_;
  cv_.NotifyAll();
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
  info.cache_dtype = CacheDtypeName(s.cache->layout());
  info.max_tokens = s.max_tokens;
  info.cross = s.cross;
  info.expires_at = s.last_used + s.idle_timeout;
  info.idle = now - s.last_used;
  return info;
}

void SessionManager::PublishCacheBytes() {
  MutexLock lock(mu_);
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

absl::Status SessionManager::CanAddLocked(const std::string& id) const {
  if (draining_ || stopping_) {
    return absl::UnavailableError("the server is shutting down: no new sessions");
  }
  if (!id.empty() && sessions_.count(id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("session ", id, " is open"));
  }
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        options_.max_sessions, " sessions are open (--max_sessions): close one first"));
  }
  return absl::OkStatus();
}

absl::Status SessionManager::CanOpenLocked(const OpenParams& params) const {
  if (draining_ || stopping_) {
    return absl::UnavailableError("the server is shutting down: no new sessions");
  }
  if (!params.memory.has_value() && !params.version->loaded.engine->CanAppendSelf()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", params.version->name,
                     " has kdim or vdim != embed_dim: it opens only "
                     "cross-attention sessions (send a memory; a sequence's start sends a key)"));
  }
  if (params.max_tokens > options_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens ", params.max_tokens,
                                                   " exceeds the server's limit of ",
                                                   options_.max_tokens, " (--session_max_tokens)"));
  }
  return CanAddLocked(params.id);
}

void SessionManager::Open(OpenParams params, OpenDone done) {
  MutexLock lock(mu_);
  if (absl::Status refused = CanOpenLocked(params); !refused.ok()) {
    lock.Unlock();
    return done(std::move(refused));
  }
  const MhaEngine& engine = *params.version->loaded.engine;
  const bool cross = params.memory.has_value();
  auto session = std::make_shared<Session>();
  session->id = params.id.empty() ? NewIdLocked() : params.id;
  session->version = params.version;
  session->cache = std::make_unique<KvCache>(engine.kv_layout(), pool_);
  session->cross = cross;
  session->max_tokens = params.max_tokens > 0 ? params.max_tokens : options_.max_tokens;
  session->idle_timeout =
      params.idle_timeout > absl::ZeroDuration() ? params.idle_timeout : options_.idle_timeout;
  session->last_used = clock_.Now();
  if (cross) {
    if (absl::Status room = ReserveLocked(*session, params.memory->kv_len()); !room.ok()) {
      lock.Unlock();
      return done(std::move(room));
    }
    session->busy = true;  // until its memory is projected
  }
  gone_.erase(session->id);
  sessions_[session->id] = session;
  ++active_per_model_[session->version->name];
  PublishLocked();
  if (cross) {  // its memory is projected by its version's batcher: a task
    const VersionPtr version = params.version;
    const RequestCost cost = CostOf(*params.memory, engine, version->batcher->MaxThreadsPerCall());
    const int64_t wire_bytes = params.memory->wire_bytes();
    auto open =
        std::make_unique<EncoderProjection>(*this, std::move(params), std::move(done), session);
    ++tasks_;
    open->queued_bytes = cost.total();  // held from arrival: it runs alone, soon
    open->wire_bytes = wire_bytes;
    lock.Unlock();
    version->batcher->Enqueue(std::move(open));
    return;
  }
  const SessionInfo info = InfoLocked(*session);
  lock.Unlock();
  done(info);
}

absl::Status SessionManager::ReopenedLocked(const Session& session) const {
  // A client-chosen id closed and opened again, maybe on a model of
  // another width, between reading the step and queueing it.
  return absl::AbortedError(absl::StrCat(
      "session ", session.id, " was closed and opened again (on model '", session.version->name,
      "' version ", session.version->version, ") while this step was read; send it again"));
}

absl::StatusOr<SessionInfo> SessionManager::Fork(const std::string& id, const std::string& new_id) {
  MutexLock lock(mu_);
  if (draining_ || stopping_) {
    return absl::UnavailableError("the server is shutting down: no new sessions");
  }
  absl::StatusOr<const Session*> found = ProjectedSessionLocked(id, ": fork it once open");
  if (!found.ok()) return found.status();
  const Session& parent = **found;
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
  MutexLock lock(mu_);
  ExpireIdleLocked();
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  SessionInfo info = InfoLocked(*it->second);
  RemoveLocked(id, "closed", "");
  return info;
}

absl::StatusOr<VersionPtr> SessionManager::VersionOf(const std::string& id) {
  MutexLock lock(mu_);
  ExpireIfIdleLocked(id);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  return it->second->version;
}

std::vector<SessionInfo> SessionManager::List(const std::string& model) const {
  MutexLock lock(mu_);
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

absl::StatusOr<const SessionManager::Session*> SessionManager::ProjectedSessionLocked(
    const std::string& id, absl::string_view advice) {
  ExpireIdleLocked();
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  const Session& s = *it->second;
  if (s.cross && s.position == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " is still projecting its memory", advice));
  }
  return &s;
}

absl::Status SessionManager::NotFoundLocked(const std::string& id) const {
  if (id.empty()) return absl::InvalidArgumentError("session_id: required (it is empty)");
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
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const std::string id = it->first;
    ++it;  // before `id` may be removed
    ExpireIfIdleLocked(id);
  }
}

void SessionManager::ExpireIfIdleLocked(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const Session& s = *it->second;
  const absl::Duration idle = clock_.Now() - s.last_used;
  if (s.busy || s.queued != 0 || idle < s.idle_timeout) return;
  RemoveLocked(id,
               absl::StrCat("expired: idle ", Seconds(idle), " (idle timeout ",
                            Seconds(s.idle_timeout), ")"),
               "expired");
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
    return TooLargeError(absl::StrCat(status.message(),
                                      "; evicting every idle session would not make room "
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
  MutexLock lock(mu_);
  while (!stopping_) {
    clock_.WaitUntil(expiry_cv_, lock, clock_.Now() + kExpiryTick);
    ExpireIdleLocked();
  }
}

}  // namespace mha::server
