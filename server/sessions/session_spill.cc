#include "server/sessions/session_spill.h"

#include <cstdio>
#include <filesystem>
#include <regex>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/models/content_hash.h"
#include "server/observability/logger.h"
#include "server/sessions/session_stream.h"

namespace mha::server {
namespace {

namespace fs = std::filesystem;

constexpr char kExtension[] = ".mhasession";

// Removes the partial files a failed or killed spill left in `dir`: only
// names SpillSessions writes (16 hex digits, kExtension, kPartialSuffix).
void RemovePartialFiles(const std::string& dir) {
  static const std::regex ours(absl::StrCat("[0-9a-f]{16}\\", kExtension, "\\", kPartialSuffix));
  std::error_code error;
  std::vector<std::string> removed;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (std::regex_match(name, ours) && it->is_regular_file(error) &&
        fs::remove(it->path(), error)) {
      removed.push_back(name);
    }
  }
  if (!removed.empty()) {
    LogInfo(absl::StrCat("removed ", removed.size(),
                         " partial session file(s) of an earlier spill ",
                         "that did not finish: ", absl::StrJoin(removed, ", ")));
  }
}

}  // namespace

SpillCounts SpillSessions(SessionManager& sessions, const std::string& dir) {
  SpillCounts counts;
  std::error_code error;
  fs::create_directories(dir, error);
  for (const std::string& id : sessions.Ids()) {
    absl::StatusOr<SessionSnapshot> snapshot = sessions.Snapshot(id);
    absl::Status status = snapshot.status();
    if (snapshot.ok()) {
      // Ids may hold ':' or '/' (sequences): the file is named by a hash.
      const std::string path = absl::StrFormat("%s/%016x%s", dir, HashBytes(id), kExtension);
      status = WriteSessionFile(path, *std::move(snapshot));
    }
    if (status.ok()) {
      ++counts.sessions;
    } else {
      ++counts.failed;
      LogError(absl::StrCat("session ", id, " not spilled: ", status.message()));
    }
  }
  return counts;
}

SpillCounts RestoreSessions(SessionManager& sessions, const ModelRepository& models,
                            const std::string& dir) {
  SpillCounts counts;
  RemovePartialFiles(dir);
  std::error_code error;
  std::vector<fs::path> files;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    if (it->path().extension() == kExtension) files.push_back(it->path());
  }
  for (const fs::path& file : files) {
    SessionChunkReader reader(LookupIn(models), sessions.cache_budget());
    absl::StatusOr<SessionImport> session = ReadSessionFile(file.string(), reader);
    absl::Status status = session.status();
    if (session.ok()) status = sessions.Import(*std::move(session)).status();
    if (status.ok()) {
      ++counts.sessions;
    } else {
      ++counts.failed;
      // The id a header names is trusted when it hashes to the file's name
      // (a corrupt header's may be another).
      const std::string& id = reader.session_id();
      const bool named =
          !id.empty() && file.stem().string() == absl::StrFormat("%016x", HashBytes(id));
      LogError(absl::StrCat("session ", named ? id : file.filename().string(),
                            " not restored: ", status.message()));
      if (named) {
        sessions.MarkGone(id, absl::StrCat("not restored after a restart: ", status.message()));
      }
    }
    fs::remove(file, error);
  }
  return counts;
}

}  // namespace mha::server
