// What a model repository holds on disk: its model folders, and in each the
// config and the version folders its version policy serves, with a
// fingerprint of their content (so that a reload happens when the bytes
// change, not when a timestamp does).
#ifndef MHA_SERVER_MODELS_REPOSITORY_SCAN_H_
#define MHA_SERVER_MODELS_REPOSITORY_SCAN_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mha/v1/model_config.pb.h"

namespace mha::server {

// Model names are folder names matching [A-Za-z0-9_.-]+ not starting with
// '.' (hidden folders are ignored), at most kMaxModelNameBytes long (they are label values, health
// service names and parts of every error message).
inline constexpr size_t kMaxModelNameBytes = 128;
bool IsValidModelName(const std::string& name);

// The model folders of `repository` with valid names, sorted (hidden ones,
// starting with '.', are ignored; other invalid names are skipped, with a
// message on stderr if `log_skipped`). NOT_FOUND when it
// cannot be read.
absl::StatusOr<std::vector<std::string>> ModelFolderNames(const std::string& repository,
                                                          bool log_skipped = true);

// Content hashes of files, recomputed only when a file's inode, size,
// mtime or ctime changed (any write changes its ctime). Not thread-safe.
class FingerprintCache {
 public:
  // The hash of the file's bytes; NOT_FOUND when it cannot be read.
  absl::StatusOr<uint64_t> Of(const std::string& path);

 private:
  struct Entry {
    uint64_t inode = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
    uint64_t hash = 0;
  };
  std::map<std::string, Entry> entries_;
};

struct VersionOnDisk {
  int64_t version = 0;
  std::string weights_path;
  uint64_t fingerprint = 0;  // of config.pbtxt and the weights, by content
};

// One model folder: `config.pbtxt`, and either numbered version folders
// (`1/weights.safetensors`, `2/...`) or, as version 1, `weights.safetensors`
// beside the config.
struct ModelOnDisk {
  v1::ModelConfig config;
  std::vector<VersionOnDisk> versions;  // what the policy serves, ascending
  // Versions the policy names (specific) that have no folder, with why.
  std::map<int64_t, std::string> missing;
};

// Reads the folder `dir` (config checked, weights not read beyond their
// fingerprint). INVALID_ARGUMENT naming the file for a bad config or
// policy; NOT_FOUND when no version has weights. `config`, when given
// (Triton's load with a config), replaces the folder's config.pbtxt.
absl::StatusOr<ModelOnDisk> ScanModelFolder(const std::string& dir, FingerprintCache& cache,
                                            const v1::ModelConfig* config = nullptr);

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_REPOSITORY_SCAN_H_
