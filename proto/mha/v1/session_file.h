// The session file format, written once: "MHASESS1", then each
// mha.v1.SessionChunk (header, blocks, trailer) as a 4-byte little-endian
// length and the message's bytes. What ExportSession streams, framed for a
// file: mha_client export_session / import_session, the server's spill
// across restarts (--session_spill_dir) and the Python client's
// Session.export / MhaClient.import_session all read and write this.
#ifndef MHA_PROTO_MHA_V1_SESSION_FILE_H_
#define MHA_PROTO_MHA_V1_SESSION_FILE_H_

#include <cstdint>
#include <istream>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mha/v1/attention.pb.h"

namespace mha::v1 {

inline constexpr char kSessionFileMagic[] = "MHASESS1";  // 8 bytes, no NUL written
// A chunk above this is a corrupt file, not a session.
inline constexpr uint32_t kMaxSessionChunkBytes = uint32_t{64} << 20;

// Writes the magic, then one chunk per Write. Not thread-safe; `out` is
// borrowed and must outlive the writer.
class SessionFileWriter {
 public:
  explicit SessionFileWriter(std::ostream& out);
  // False once the stream failed.
  bool Write(const SessionChunk& chunk);

 private:
  std::ostream& out_;
  std::string bytes_;
};

// Reads what SessionFileWriter wrote. Not thread-safe; `in` is borrowed.
class SessionFileReader {
 public:
  explicit SessionFileReader(std::istream& in) : in_(in) {}
  // The magic: INVALID_ARGUMENT "not a session file" otherwise. First.
  absl::Status Open();
  // The next chunk into `chunk`: true, or false at the end of the file;
  // DATA_LOSS for a truncated, oversized or corrupt chunk, or one not
  // written as SessionFileWriter writes it (so that every byte counts:
  // e.g. a bool of 3 reads as 1, and then the checksum would not see it).
  absl::StatusOr<bool> Next(SessionChunk& chunk);

 private:
  // Whether `chunk` serializes back to exactly bytes_ (blocks: its size).
  bool Canonical(const SessionChunk& chunk) const;

  std::istream& in_;
  std::string bytes_;
};

}  // namespace mha::v1

#endif  // MHA_PROTO_MHA_V1_SESSION_FILE_H_
