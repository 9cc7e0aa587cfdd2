#include "engine/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/file_read.h"
#include "engine/status_macros.h"
#include "nlohmann/json.hpp"

namespace mha {
namespace {

using nlohmann::json;

absl::StatusOr<DType> FileDType(const std::string& name, const std::string& tensor) {
  if (std::optional<DType> dtype = ParseDType(name, DTypeSpelling::kSafetensors)) return *dtype;
  return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': unsupported dtype '", name,
                                                 "' (expected F32, F16, BF16 or BOOL)"));
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

absl::StatusOr<std::vector<int64_t>> ParseShape(const json& value, const std::string& tensor) {
  if (!value.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "': 'shape' must be an array"));
  }
  std::vector<int64_t> shape;
  for (const json& d : value) {
    if (!d.is_number_unsigned() ||
        d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor, "': shape entries must be integers in [0, 2^63)"));
    }
    shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  return shape;
}

absl::StatusOr<Entry> ParseEntry(const std::string& name, const json& value) {
  auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", what));
  };
  if (!value.is_object()) return fail("header entry must be an object");
  if (!value.contains("dtype") || !value["dtype"].is_string())
    return fail("missing string 'dtype'");
  if (!value.contains("shape")) return fail("missing 'shape'");
  if (!value.contains("data_offsets") || !value["data_offsets"].is_array() ||
      value["data_offsets"].size() != 2 || !value["data_offsets"][0].is_number_unsigned() ||
      !value["data_offsets"][1].is_number_unsigned())
    return fail("'data_offsets' must be two non-negative integers");
  Entry e;
  e.name = name;
  ASSIGN_OR_RETURN(e.dtype, FileDType(value["dtype"].get<std::string>(), name));
  ASSIGN_OR_RETURN(e.shape, ParseShape(value["shape"], name));
  e.begin = value["data_offsets"][0].get<uint64_t>();
  e.end = value["data_offsets"][1].get<uint64_t>();
  return e;
}

absl::Status CheckEntry(const Entry& e, uint64_t data_size) {
  const absl::StatusOr<int64_t> elements = NumElements(e.shape);
  if (!elements.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", e.name, "': ", elements.status().message()));
  }
  const int64_t count = *elements;
  const uint64_t elem = DTypeSize(e.dtype);
  if (e.begin > e.end || e.end > data_size) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", e.name, "': data_offsets [", e.begin,
                                                   ", ", e.end, "] outside the data section of ",
                                                   data_size, " bytes"));
  }
  if (static_cast<uint64_t>(count) > data_size / elem ||
      static_cast<uint64_t>(count) * elem != e.end - e.begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", e.name, "': ", DTypeName(e.dtype), " ", ShapeString(e.shape), " needs ",
        static_cast<uint64_t>(count) * elem, " bytes, data_offsets span ", e.end - e.begin));
  }
  return absl::OkStatus();
}

// Non-empty byte ranges must not overlap (an empty tensor occupies none).
absl::Status CheckNoOverlap(std::vector<const Entry*> entries) {
  std::erase_if(entries, [](const Entry* e) { return e->begin == e->end; });
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  for (size_t i = 1; i < entries.size(); ++i) {
    if (entries[i]->begin < entries[i - 1]->end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", entries[i]->name, "' overlaps tensor '", entries[i - 1]->name, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TensorMap> ParseSafetensors(std::string_view bytes) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: file of ", bytes.size(), " bytes has no 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  }
  if (header_len > kMaxSafetensorsHeaderBytes || header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a safetensors file (header length ", header_len, " exceeds the file's ",
                     bytes.size() - 8,
                     " bytes after the length, or the limit; safetensors files start "
                     "with a little-endian header length and a JSON header)"));
  }
  const std::string_view header_text = bytes.substr(8, header_len);
  const json header =
      json::parse(header_text.begin(), header_text.end(), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  const std::string_view data = bytes.substr(8 + header_len);
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    ASSIGN_OR_RETURN(Entry e, ParseEntry(name, value));
    RETURN_IF_ERROR(CheckEntry(e, data.size()));
    entries.push_back(std::move(e));
  }
  std::vector<const Entry*> pointers;
  for (const Entry& e : entries) pointers.push_back(&e);
  RETURN_IF_ERROR(CheckNoOverlap(std::move(pointers)));

  TensorMap tensors;
  for (Entry& e : entries) {
    Tensor t(e.dtype, std::move(e.shape));
    if (t.num_bytes() > 0) std::memcpy(t.raw(), data.data() + e.begin, t.num_bytes());
    tensors.emplace(e.name, std::move(t));
  }
  return tensors;
}

absl::StatusOr<TensorMap> ReadSafetensors(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<TensorMap> parsed = ParseSafetensors(*bytes);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

std::string SerializeSafetensors(const TensorMap& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", DTypeName(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.num_bytes()}}};
    offset += t.num_bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out += text;
  for (const auto& [name, t] : tensors) {
    out.append(reinterpret_cast<const char*>(t.raw()), t.num_bytes());
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const TensorMap& tensors) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  const std::string bytes = SerializeSafetensors(tensors);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::InternalError(absl::StrCat("write failed: ", path));
  return absl::OkStatus();
}

}  // namespace mha
