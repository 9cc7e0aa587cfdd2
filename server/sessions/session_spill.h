// Sessions that survive a restart (--session_spill_dir): written to files at
// shutdown, after the grace period's steps, and imported at the next start,
// with their ids, positions and remaining idle time, when their model
// version still serves (the same fingerprint).
#ifndef MHA_SERVER_SESSIONS_SESSION_SPILL_H_
#define MHA_SERVER_SESSIONS_SESSION_SPILL_H_

#include <cstdint>
#include <string>

#include "server/models/model_repository.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

struct SpillCounts {
  int64_t sessions = 0;  // written, or restored
  int64_t failed = 0;    // could not be written, or could not come back
};

// Writes every session of `sessions` to `dir` (created if missing), one
// file each (the session stream format). Errors go to stderr and count.
SpillCounts SpillSessions(SessionManager& sessions, const std::string& dir);

// Removes the partial files a killed spill left in `dir` (only names a
// spill writes; logged), then imports the session files, then removes them. A session that
// cannot come back (its version is gone or changed, the cache is too
// small, the file is corrupt) is remembered with why, for its next call's
// NOT_FOUND.
SpillCounts RestoreSessions(SessionManager& sessions, const ModelRepository& models,
                            const std::string& dir);

}  // namespace mha::server

#endif  // MHA_SERVER_SESSIONS_SESSION_SPILL_H_
