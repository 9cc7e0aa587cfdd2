#include "engine/file_read.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace mha {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(absl::StrCat("no such file: ", path));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  if (in) bytes << in.rdbuf();
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return std::move(bytes).str();
}

}  // namespace mha
