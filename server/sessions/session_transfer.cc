// SessionManager's transfers: a session leaving (Snapshot) and arriving
// (Import), for ExportSession / ImportSession and the spill at shutdown.
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "server/sessions/session_internal.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

absl::StatusOr<SessionSnapshot> SessionManager::Snapshot(const std::string& id) {
  MutexLock lock(mu_);
  absl::StatusOr<const Session*> found = ProjectedSessionLocked(id, "");
  if (!found.ok()) return found.status();
  const Session& s = **found;
  SessionSnapshot snapshot;
  snapshot.info = InfoLocked(s);
  snapshot.version = s.version;
  snapshot.idle_timeout = s.idle_timeout;
  snapshot.idle_left = std::max(absl::ZeroDuration(), s.idle_timeout - snapshot.info.idle);
  // Up to its last answered step: a step running now writes past it.
  snapshot.cache = s.cache->Fork(s.position);
  return snapshot;
}

std::vector<std::string> SessionManager::Ids() const {
  MutexLock lock(mu_);
  std::vector<std::string> ids;
  ids.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  return ids;
}

void SessionManager::MarkGone(const std::string& id, const std::string& why) {
  MutexLock lock(mu_);
  if (sessions_.count(id) == 0) RememberGoneLocked(id, why);
}

absl::StatusOr<SessionInfo> SessionManager::Import(SessionImport in) {
  const MhaEngine& engine = *in.version->loaded.engine;
  const KvLayout& layout = engine.kv_layout();
  if (static_cast<int64_t>(in.blocks.size()) != layout.BlocksFor(in.position)) {
    return absl::InvalidArgumentError(absl::StrCat(in.blocks.size(), " blocks for ", in.position,
                                                   " tokens; expected ",
                                                   layout.BlocksFor(in.position)));
  }
  for (const std::string& b : in.blocks) {
    if (static_cast<int64_t>(b.size()) != layout.block_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a block of ", b.size(), " bytes; expected ", layout.block_bytes()));
    }
  }
  if (!in.key_padding.empty() &&
      (!in.cross || static_cast<int64_t>(in.key_padding.size()) != in.position)) {
    return absl::InvalidArgumentError("key padding: one value per memory token, cross only");
  }
  if (!in.cross && !engine.CanAppendSelf()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", in.version->name, " opens only cross-attention sessions"));
  }
  if (in.position < (in.cross ? 1 : 0) || in.max_tokens < 1 ||
      (!in.cross && in.position > in.max_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("position ", in.position, " and max_tokens ",
                                                   in.max_tokens, " do not make a session"));
  }
  if (in.max_tokens > options_.max_tokens) {
    return absl::OutOfRangeError(absl::StrCat("max_tokens ", in.max_tokens,
                                              " exceeds the server's limit of ",
                                              options_.max_tokens, " (--session_max_tokens)"));
  }
  auto session = std::make_shared<Session>();
  session->id = in.id;
  session->version = in.version;
  session->cache = std::make_unique<KvCache>(layout, pool_);
  session->cross = in.cross;
  session->max_tokens = in.max_tokens;
  session->idle_timeout =
      in.idle_timeout > absl::ZeroDuration() ? in.idle_timeout : options_.idle_timeout;
  session->position = in.position;
  {
    MutexLock lock(mu_);
    if (absl::Status s = CanAddLocked(in.id); !s.ok()) return s;
    if (absl::Status s = ReserveLocked(*session, in.position); !s.ok()) return s;
  }
  // The copy runs outside the lock: the blocks are this cache's alone.
  for (size_t b = 0; b < in.blocks.size(); ++b) {
    session->cache->WriteBlock(static_cast<int64_t>(b),
                               reinterpret_cast<const uint8_t*>(in.blocks[b].data()));
  }
  session->cache->set_length(in.position);
  if (!in.key_padding.empty()) session->cache->set_key_padding(std::move(in.key_padding));
  MutexLock lock(mu_);
  if (absl::Status s = CanAddLocked(in.id); !s.ok()) return s;  // the blocks go back with `session`
  const absl::Duration left = std::clamp(in.idle_left, absl::ZeroDuration(), session->idle_timeout);
  session->last_used = clock_.Now() - (session->idle_timeout - left);
  gone_.erase(session->id);
  sessions_[session->id] = session;
  ++active_per_model_[session->version->name];
  PublishLocked();
  return InfoLocked(*session);
}

}  // namespace mha::server
