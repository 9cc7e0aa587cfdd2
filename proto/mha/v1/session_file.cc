#include "mha/v1/session_file.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace mha::v1 {

SessionFileWriter::SessionFileWriter(std::ostream& out) : out_(out) {
  out_.write(kSessionFileMagic, 8);
}

bool SessionFileWriter::Write(const SessionChunk& chunk) {
  chunk.SerializeToString(&bytes_);
  const uint32_t size = static_cast<uint32_t>(bytes_.size());
  const unsigned char prefix[4] = {
      static_cast<unsigned char>(size), static_cast<unsigned char>(size >> 8),
      static_cast<unsigned char>(size >> 16), static_cast<unsigned char>(size >> 24)};
  out_.write(reinterpret_cast<const char*>(prefix), 4);
  out_.write(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
  return static_cast<bool>(out_);
}

absl::Status SessionFileReader::Open() {
  char magic[8];
  if (!in_.read(magic, 8) || std::memcmp(magic, kSessionFileMagic, 8) != 0) {
    return absl::InvalidArgumentError("not a session file (no MHASESS1 header)");
  }
  return absl::OkStatus();
}

bool SessionFileReader::Canonical(const SessionChunk& chunk) const {
  if (chunk.ByteSizeLong() != bytes_.size()) return false;
  if (chunk.has_block()) return true;  // its bytes are read as they are
  return chunk.SerializeAsString() == bytes_;
}

absl::StatusOr<bool> SessionFileReader::Next(SessionChunk& chunk) {
  unsigned char prefix[4];
  if (!in_.read(reinterpret_cast<char*>(prefix), 4)) {
    if (in_.gcount() == 0) return false;  // the end, between chunks
    return absl::DataLossError("a truncated chunk length");
  }
  const uint32_t size =
      prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) | (static_cast<uint32_t>(prefix[3]) << 24);
  if (size > kMaxSessionChunkBytes) {
    return absl::DataLossError(absl::StrCat("a chunk of ", size, " bytes"));
  }
  bytes_.resize(size);
  if (!in_.read(bytes_.data(), size) || !chunk.ParseFromString(bytes_) || !Canonical(chunk)) {
    return absl::DataLossError("a truncated or corrupt chunk");
  }
  return true;
}

}  // namespace mha::v1
