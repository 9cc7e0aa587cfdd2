#include "wire/wire_reader.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "wire/wire_writer.h"

namespace mha::wire {
namespace {

constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// Walks the received pieces in order. Not thread-safe; borrows the pieces.
class PieceCursor {
 public:
  explicit PieceCursor(const WirePieces& pieces) : pieces_(pieces) { SkipEmpty(); }

  int64_t position() const { return position_; }

  bool Next(uint8_t& byte) {
    if (piece_ >= pieces_.size()) return false;
    byte = pieces_[piece_][offset_];
    Advance(1);
    return true;
  }

  // Moves over `n` bytes (all there: the caller checked), adding them to
  // `copy` or to `out` as pieces.
  void Take(int64_t n, std::string* copy, WirePieces* out) {
    while (n > 0) {
      const absl::Span<const uint8_t> piece = pieces_[piece_];
      const size_t k = std::min<size_t>(static_cast<size_t>(n), piece.size() - offset_);
      const absl::Span<const uint8_t> part = piece.subspan(offset_, k);
      if (copy != nullptr) copy->append(reinterpret_cast<const char*>(part.data()), k);
      if (out != nullptr) out->push_back(part);
      Advance(k);
      n -= static_cast<int64_t>(k);
    }
  }

 private:
  void Advance(size_t k) {
    offset_ += k;
    position_ += static_cast<int64_t>(k);
    if (offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (piece_ < pieces_.size() && pieces_[piece_].empty()) ++piece_;
  }

  const WirePieces& pieces_;
  size_t piece_ = 0, offset_ = 0;
  int64_t position_ = 0;
};

// A varint of at most `max_bytes` bytes before `end`, its bytes appended to
// `raw`; nullopt when longer, truncated, or (with `minimal`) not in its
// shortest form.
std::optional<uint64_t> ReadVarint(PieceCursor& c, int64_t end, int max_bytes, bool minimal,
                                   std::string& raw) {
  uint64_t value = 0;
  for (int i = 0; i < max_bytes && c.position() < end; ++i) {
    uint8_t byte = 0;
    if (!c.Next(byte)) return std::nullopt;
    raw.push_back(static_cast<char>(byte));
    value |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
    if ((byte & 0x80) == 0) {
      if (minimal && i > 0 && byte == 0) return std::nullopt;
      return value;
    }
  }
  return std::nullopt;
}

const PayloadField* FindField(absl::Span<const PayloadField> fields, int number) {
  for (const PayloadField& f : fields) {
    if (f.number == number) return &f;
  }
  return nullptr;
}

// Copies the fields of one message (up to `end`) into `header`, except the
// payloads, which go to `payloads`. False when something is unusual: the
// caller then leaves the whole message to protobuf.
bool Walk(PieceCursor& c, int64_t end, absl::Span<const PayloadField> fields,
          std::vector<int>& path, std::string& header, std::vector<WirePayload>& payloads) {
  while (c.position() < end) {
    std::string tag_bytes;
    // Protobuf's tags are at most 5 bytes; a field number of 0 is invalid.
    const std::optional<uint64_t> tag = ReadVarint(c, end, 5, true, tag_bytes);
    if (!tag.has_value() || *tag > 0xffffffffu || (*tag >> 3) == 0) return false;
    const int wire_type = static_cast<int>(*tag & 7);
    const int64_t number = static_cast<int64_t>(*tag >> 3);
    header += tag_bytes;
    if (wire_type == kVarint) {
      if (!ReadVarint(c, end, 10, false, header).has_value()) return false;
      continue;
    }
    if (wire_type == kFixed64 || wire_type == kFixed32) {
      const int64_t n = wire_type == kFixed64 ? 8 : 4;
      if (end - c.position() < n) return false;
      c.Take(n, &header, nullptr);
      continue;
    }
    if (wire_type != kLengthDelimited) return false;  // groups and invalid types
    std::string length_bytes;
    // As protobuf's ReadSize: at most 5 bytes, below 2^31.
    const std::optional<uint64_t> length = ReadVarint(c, end, 5, true, length_bytes);
    if (!length.has_value() || *length >= (uint64_t{1} << 31) ||
        static_cast<int64_t>(*length) > end - c.position()) {
      return false;
    }
    const int64_t size = static_cast<int64_t>(*length);
    const PayloadField* field = FindField(fields, static_cast<int>(number));
    if (field == nullptr) {
      header += length_bytes;
      c.Take(size, &header, nullptr);
    } else if (field->inner.empty()) {
      WirePayload payload;
      payload.path = path;
      payload.path.push_back(field->number);
      payload.size = size;
      c.Take(size, nullptr, &payload.pieces);
      payloads.push_back(std::move(payload));
      header.push_back('\0');  // an empty field in its place
    } else {
      std::string inner;
      path.push_back(field->number);
      const bool ok = Walk(c, c.position() + size, field->inner, path, inner, payloads);
      path.pop_back();
      if (!ok) return false;
      AppendVarint(inner.size(), header);
      header += inner;
    }
  }
  return true;
}

absl::Status ParseWhole(const WirePieces& pieces, const char* what,
                        google::protobuf::MessageLite& message) {
  std::string whole;
  AppendPieces(pieces, whole);
  if (!message.ParseFromString(whole)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        ": not a valid protobuf message (truncated, malformed, or a string that is not UTF-8)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadWireMessage(const WirePieces& pieces, absl::Span<const PayloadField> fields,
                             const char* what, google::protobuf::MessageLite& header,
                             ReadResult& result) {
  int64_t total = 0;
  for (absl::Span<const uint8_t> piece : pieces) total += static_cast<int64_t>(piece.size());
  PieceCursor cursor(pieces);
  std::string header_bytes;
  std::vector<int> path;
  result = ReadResult{};
  if (!Walk(cursor, total, fields, path, header_bytes, result.payloads)) {
    result = ReadResult{.payloads = {}, .whole = true};
    return ParseWhole(pieces, what, header);
  }
  if (!header.ParseFromString(header_bytes)) {
    result = ReadResult{};
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        ": not a valid protobuf message (truncated, malformed, or a string that is not UTF-8)"));
  }
  return absl::OkStatus();
}

void AppendPieces(const WirePieces& pieces, std::string& out) {
  for (absl::Span<const uint8_t> piece : pieces) {
    out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
}

absl::Status SlicesOf(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>& slices,
                      WirePieces& pieces) {
  if (grpc::Status dumped = buffer.Dump(&slices); !dumped.ok()) {
    return absl::InternalError(dumped.error_message());
  }
  pieces.clear();
  for (const grpc::Slice& slice : slices) pieces.emplace_back(slice.begin(), slice.size());
  return absl::OkStatus();
}

const WirePayload* LastPayload(const ReadResult& result, absl::Span<const int> path) {
  for (auto it = result.payloads.rbegin(); it != result.payloads.rend(); ++it) {
    if (absl::MakeConstSpan(it->path) == path) return &*it;
  }
  return nullptr;
}

}  // namespace mha::wire
