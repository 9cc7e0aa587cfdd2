#include "server/sessions/session_stream.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/mha_engine.h"
#include "engine/too_large.h"
#include "server/sessions/session_manager.h"

namespace mha::server {
namespace {

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

// Starts `checksum` with the magic and `header` (its header_checksum left
// out): the format-2 header checksum, which the blocks then continue.
uint64_t StartChecksum(const v1::SessionHeader& header, ContentHash& checksum) {
  v1::SessionHeader unchecked = header;
  unchecked.clear_header_checksum();
  checksum.Update(absl::string_view(v1::kSessionFileMagic, 8));
  checksum.Update(unchecked.SerializeAsString());
  return checksum.Finish();
}

}  // namespace

VersionLookup LookupIn(const ModelRepository& models) {
  return
      [&models](const std::string& model, int64_t version) { return models.Find(model, version); };
}

SessionChunkWriter::SessionChunkWriter(SessionSnapshot snapshot) : snapshot_(std::move(snapshot)) {}

bool SessionChunkWriter::Next(v1::SessionChunk& out) {
  out.Clear();
  if (done_) return false;
  const KvCache& cache = *snapshot_.cache;
  const KvLayout& layout = cache.layout();
  const int64_t blocks = layout.BlocksFor(snapshot_.info.position);
  if (next_block_ < 0) {
    v1::SessionHeader& h = *out.mutable_header();
    h.set_format_version(kSessionFormatVersion);
    h.set_session_id(snapshot_.info.id);
    h.set_model(snapshot_.info.model);
    h.set_model_version(snapshot_.info.version);
    h.set_fingerprint(snapshot_.version->fingerprint);
    h.set_heads(layout.heads);
    h.set_qk_head_dim(layout.qk_head_dim);
    h.set_v_head_dim(layout.v_head_dim);
    h.set_cache_dtype(CacheDtypeName(layout));
    h.set_position(snapshot_.info.position);
    h.set_cross(snapshot_.info.cross);
    h.set_max_tokens(snapshot_.info.max_tokens);
    h.set_idle_timeout_ms(absl::ToInt64Milliseconds(snapshot_.idle_timeout));
    h.set_idle_left_ms(absl::ToInt64Milliseconds(snapshot_.idle_left));
    h.set_blocks(blocks);
    h.set_block_bytes(layout.block_bytes());
    const std::vector<float>& padding = cache.key_padding();
    if (!padding.empty()) h.set_key_padding(padding.data(), padding.size() * sizeof(float));
    h.set_header_checksum(StartChecksum(h, checksum_));
    next_block_ = 0;
    return true;
  }
  if (next_block_ < blocks) {
    std::string* bytes = out.mutable_block();
    bytes->resize(static_cast<size_t>(layout.block_bytes()));
    cache.ReadBlock(next_block_++, reinterpret_cast<uint8_t*>(bytes->data()));
    checksum_.Update(*bytes);
    return true;
  }
  out.mutable_trailer()->set_checksum(checksum_.Finish());
  done_ = true;
  snapshot_.cache.reset();  // the blocks go back once sent
  return true;
}

absl::Status SessionChunkReader::CheckHeader(const v1::SessionHeader& h) {
  if (h.format_version() == 1 && h.header_checksum() == 0) {
    return absl::OkStatus();  // format 1: the trailer covers the blocks alone
  }
  if (StartChecksum(h, checksum_) != h.header_checksum()) {
    return absl::DataLossError(absl::StrCat("session ", h.session_id(),
                                            ": the header's checksum does not match; the "
                                            "session file or stream is corrupt"));
  }
  if (h.format_version() != kSessionFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session format version ", h.format_version(), "; this server reads 1 and ",
        kSessionFormatVersion, " (a newer server wrote it: import it on one of that version)"));
  }
  return absl::OkStatus();
}

absl::Status SessionChunkReader::AddHeader(const v1::SessionChunk& chunk) {
  const v1::SessionHeader& h = chunk.header();
  header_id_ = h.session_id();
  if (absl::Status checked = CheckHeader(h); !checked.ok()) return checked;
  absl::StatusOr<VersionPtr> found = lookup_(h.model(), h.model_version());
  if (!found.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "session ", h.session_id(), " was made on model ", h.model(), " version ",
        h.model_version(), ", which this server does not serve (", found.status().message(), ")"));
  }
  const VersionPtr& version = *found;
  if (version->fingerprint != h.fingerprint()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", h.session_id(), " was made on model ", h.model(), " version ",
                     h.model_version(), " with fingerprint ", Hex(h.fingerprint()),
                     "; this server's has fingerprint ", Hex(version->fingerprint),
                     " (other weights or config)"));
  }
  const KvLayout& layout = version->loaded.engine->kv_layout();
  if (h.heads() != layout.heads || h.qk_head_dim() != layout.qk_head_dim ||
      h.v_head_dim() != layout.v_head_dim || h.cache_dtype() != CacheDtypeName(layout) ||
      h.block_bytes() != layout.block_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session header: heads ", h.heads(), ", head dims ", h.qk_head_dim(), "/",
                     h.v_head_dim(), ", ", h.cache_dtype(), ", blocks of ", h.block_bytes(),
                     " bytes do not match the model's cache layout"));
  }
  if (h.position() < (h.cross() ? 1 : 0) || (!h.cross() && h.position() > h.max_tokens())) {
    return absl::InvalidArgumentError(absl::StrCat("session header: position ", h.position(),
                                                   " with max_tokens ", h.max_tokens()));
  }
  if (h.blocks() != layout.BlocksFor(h.position())) {
    return absl::InvalidArgumentError(
        absl::StrCat("session header: ", h.blocks(), " blocks for position ", h.position()));
  }
  if (h.blocks() > max_bytes_ / layout.block_bytes()) {
    return TooLargeError(absl::StrCat("session of ", h.blocks(), " blocks of ",
                                      layout.block_bytes(), " bytes: more than the cache holds (",
                                      max_bytes_, " bytes)"));
  }
  const std::string& padding = h.key_padding();
  if (padding.size() % sizeof(float) != 0 ||
      (!padding.empty() &&
       (!h.cross() || padding.size() / sizeof(float) != static_cast<size_t>(h.position())))) {
    return absl::InvalidArgumentError("session header: key_padding is not one f32 per token");
  }
  SessionImport in;
  in.version = version;
  in.id = chunk.import_as().empty() ? h.session_id() : chunk.import_as();
  in.position = h.position();
  in.cross = h.cross();
  in.max_tokens = h.max_tokens();
  in.idle_timeout = absl::Milliseconds(std::max<int64_t>(0, h.idle_timeout_ms()));
  in.idle_left = absl::Milliseconds(std::max<int64_t>(0, h.idle_left_ms()));
  in.key_padding.resize(padding.size() / sizeof(float));
  if (!padding.empty()) std::memcpy(in.key_padding.data(), padding.data(), padding.size());
  for (const float p : in.key_padding) {
    if (!(p == 0.0f || (std::isinf(p) && p < 0))) {
      return absl::InvalidArgumentError("session header: key_padding holds 0 or -inf only");
    }
  }
  in.blocks.reserve(static_cast<size_t>(h.blocks()));
  blocks_expected_ = h.blocks();
  session_ = std::move(in);
  return absl::OkStatus();
}

absl::Status SessionChunkReader::Add(const v1::SessionChunk& chunk) {
  if (trailer_seen_) return absl::InvalidArgumentError("session stream: a chunk after the trailer");
  switch (chunk.part_case()) {
    case v1::SessionChunk::kHeader:
      if (session_.has_value()) return absl::InvalidArgumentError("session stream: two headers");
      return AddHeader(chunk);
    case v1::SessionChunk::kBlock: {
      if (!session_.has_value()) {
        return absl::InvalidArgumentError("session stream: a block before the header");
      }
      if (static_cast<int64_t>(session_->blocks.size()) == blocks_expected_) {
        return absl::InvalidArgumentError(
            absl::StrCat("session stream: more than the header's ", blocks_expected_, " blocks"));
      }
      const int64_t block_bytes = session_->version->loaded.engine->kv_layout().block_bytes();
      if (static_cast<int64_t>(chunk.block().size()) != block_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("session stream: a block of ",
                                                       chunk.block().size(), " bytes; blocks are ",
                                                       block_bytes));
      }
      checksum_.Update(chunk.block());
      session_->blocks.push_back(chunk.block());
      return absl::OkStatus();
    }
    case v1::SessionChunk::kTrailer:
      if (!session_.has_value() ||
          static_cast<int64_t>(session_->blocks.size()) != blocks_expected_) {
        return absl::InvalidArgumentError(
            absl::StrCat("session stream: the trailer after ",
                         session_.has_value() ? session_->blocks.size() : 0, " of ",
                         blocks_expected_, " blocks"));
      }
      if (chunk.trailer().checksum() != checksum_.Finish()) {
        return absl::DataLossError(absl::StrCat("session ", header_id_,
                                                ": the checksum does not match; the session "
                                                "file or stream is corrupt"));
      }
      trailer_seen_ = true;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError("session stream: an empty chunk");
  }
}

absl::StatusOr<SessionImport> SessionChunkReader::Finish() {
  if (!trailer_seen_) {
    return absl::InvalidArgumentError(
        absl::StrCat("session stream ended early: ", session_.has_value() ? "" : "no header, ",
                     session_.has_value() ? session_->blocks.size() : 0, " of ", blocks_expected_,
                     " blocks, no trailer"));
  }
  SessionImport done = *std::move(session_);
  session_.reset();
  return done;
}

namespace {

// `snapshot`'s chunks into a new file at `path`.
absl::Status WriteChunks(const std::string& path, SessionSnapshot snapshot) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  v1::SessionFileWriter file(out);
  SessionChunkWriter writer(std::move(snapshot));
  v1::SessionChunk chunk;
  while (writer.Next(chunk) && file.Write(chunk)) {
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSessionFile(const std::string& path, SessionSnapshot snapshot) {
  const std::string temporary = path + kPartialSuffix;
  absl::Status written = WriteChunks(temporary, std::move(snapshot));
  if (written.ok() && std::rename(temporary.c_str(), path.c_str()) != 0) {
    written = absl::InternalError(absl::StrCat("cannot rename ", temporary));
  }
  if (!written.ok()) std::remove(temporary.c_str());  // nothing half-written stays
  return written;
}

absl::StatusOr<SessionImport> ReadSessionFile(const std::string& path, SessionChunkReader& reader) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  v1::SessionFileReader file(in);
  // In a file, whatever is malformed is corrupt: DATA_LOSS, naming both.
  auto in_file = [&path, &reader](const absl::Status& s) {
    const bool corrupt =
        s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kDataLoss;
    return absl::Status(corrupt ? absl::StatusCode::kDataLoss : s.code(),
                        absl::StrCat(path, " (session ",
                                     reader.session_id().empty() ? "unknown" : reader.session_id(),
                                     "): ", s.message()));
  };
  if (absl::Status s = file.Open(); !s.ok()) return in_file(s);
  v1::SessionChunk chunk;
  while (true) {
    absl::StatusOr<bool> more = file.Next(chunk);
    if (!more.ok()) return in_file(more.status());
    if (!*more) break;
    if (!chunk.import_as().empty()) {  // a caller's request, never in a file
      return in_file(absl::InvalidArgumentError("a chunk with import_as"));
    }
    if (absl::Status s = reader.Add(chunk); !s.ok()) return in_file(s);
  }
  absl::StatusOr<SessionImport> session = reader.Finish();
  if (!session.ok()) return in_file(session.status());
  return session;
}

}  // namespace mha::server
