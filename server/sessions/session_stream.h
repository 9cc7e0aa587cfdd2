// A session as a stream of chunks (mha.v1 SessionChunk): what ExportSession
// sends, ImportSession reads, and --session_spill_dir files hold. The
// format is versioned (SessionHeader.format_version) and checked as it is
// read: every byte by one checksum (the header's before it is used, the
// trailer's at the end; attention.proto), the model version by its
// fingerprint, the sizes by the header.
#ifndef MHA_SERVER_SESSIONS_SESSION_STREAM_H_
#define MHA_SERVER_SESSIONS_SESSION_STREAM_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mha/v1/attention.pb.h"
#include "mha/v1/session_file.h"
#include "server/models/content_hash.h"
#include "server/models/model_repository.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

inline constexpr uint32_t kSessionFormatVersion = 2;  // written; 1 is read too

// Gives a snapshot's chunks one at a time: the header, each block, the
// trailer. Owns the snapshot (its blocks stay alive until it is done).
// Not thread-safe.
class SessionChunkWriter {
 public:
  explicit SessionChunkWriter(SessionSnapshot snapshot);
  // The next chunk into `out`; false once the trailer was given.
  bool Next(v1::SessionChunk& out);

 private:
  SessionSnapshot snapshot_;
  int64_t next_block_ = -1;  // -1: the header is next
  ContentHash checksum_;
  bool done_ = false;
};

// The version a header names, as ModelRepository::Find answers.
using VersionLookup =
    std::function<absl::StatusOr<VersionPtr>(const std::string& model, int64_t version)>;
VersionLookup LookupIn(const ModelRepository& models);  // borrows `models`

// Reads a session's chunks back, checking each as it comes, so a bad
// stream is refused before it is read whole. The header's version must be
// served (`lookup`), with the same fingerprint. Not thread-safe.
class SessionChunkReader {
 public:
  // `max_bytes`: the most block bytes a header may announce (the cache).
  SessionChunkReader(VersionLookup lookup, int64_t max_bytes)
      : lookup_(std::move(lookup)), max_bytes_(max_bytes) {}

  // DATA_LOSS for a checksum that does not match (the header's or the
  // trailer's, naming the session), FAILED_PRECONDITION for another
  // fingerprint (naming both), NOT_FOUND
  // for a version not served, INVALID_ARGUMENT for anything malformed or
  // out of order, RESOURCE_EXHAUSTED for a session larger than `max_bytes`.
  absl::Status Add(const v1::SessionChunk& chunk);
  // Once the stream ended: the session to import (with the header's idle
  // time left), or INVALID_ARGUMENT when it stopped short.
  absl::StatusOr<SessionImport> Finish();
  // The header's session id, once a header arrived (even a refused one).
  const std::string& session_id() const { return header_id_; }

 private:
  absl::Status AddHeader(const v1::SessionChunk& chunk);
  // DATA_LOSS when the header's checksum does not match,
  // FAILED_PRECONDITION for a format this server does not read.
  absl::Status CheckHeader(const v1::SessionHeader& header);

  const VersionLookup lookup_;
  const int64_t max_bytes_;
  std::optional<SessionImport> session_;
  int64_t blocks_expected_ = 0;
  ContentHash checksum_;
  bool trailer_seen_ = false;
  std::string header_id_;
};

// What a file is called while WriteSessionFile writes it.
inline constexpr char kPartialSuffix[] = ".partial";

// `snapshot` as a file at `path`: written to `path` + kPartialSuffix, then
// renamed; on failure that temporary file is removed.
absl::Status WriteSessionFile(const std::string& path, SessionSnapshot snapshot);
// The session in the file at `path`, read through `reader`. Anything
// malformed or corrupt is DATA_LOSS, naming the file and the session.
absl::StatusOr<SessionImport> ReadSessionFile(const std::string& path, SessionChunkReader& reader);

}  // namespace mha::server

#endif  // MHA_SERVER_SESSIONS_SESSION_STREAM_H_
