// SessionManager's record of one session, shared by its .cc files (the
// registry and steps; the transfers). Not part of the module's interface.
#ifndef MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_
#define MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "engine/kv_cache.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// Guarded by SessionManager::mu_, except the cache's contents, which the
// worker computing the session's step writes.
struct SessionManager::Session {
  std::string id;
  VersionPtr version;
  std::unique_ptr<KvCache> cache;
  bool cross = false;
  int64_t max_tokens = 0;
  absl::Duration idle_timeout;
  absl::Time last_used;
  bool busy = false;   // a step (or its memory's projection) is computing
  int64_t queued = 0;  // steps waiting
  // The cache's length as of the last finished step: what other threads
  // read (the batcher worker computing its step writes the cache's own
  // length outside mu_).
  int64_t position = 0;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_
