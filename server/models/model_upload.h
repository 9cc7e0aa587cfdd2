// A model sent over the API (Triton's RepositoryModelLoad with `file:`
// parameters): its files, checked and written to a private folder that the
// load reads and then removes.
#ifndef MHA_SERVER_MODELS_MODEL_UPLOAD_H_
#define MHA_SERVER_MODELS_MODEL_UPLOAD_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::server {

// Bounds of one upload.
inline constexpr size_t kMaxUploadFiles = 64;

// Whether `path` is a file a model folder holds: `weights.safetensors`
// (version 1) or `<version>/weights.safetensors` (a positive number without
// leading zeros). Anything else, absolute paths and `..` included, is
// INVALID_ARGUMENT naming it. The config is sent apart, never as a file.
absl::Status CheckUploadPath(const std::string& path);

// Writes `files` (relative path -> bytes, each path checked first: nothing
// is written when one is refused) to a new folder, mode 0700, under `root`
// ("" : $TMPDIR or /tmp), and returns the folder. Files are created, never
// opened if they exist, and never followed through a symbolic link.
absl::StatusOr<std::string> WriteUpload(const std::string& root,
                                        const std::map<std::string, absl::string_view>& files);

// Removes a folder WriteUpload made, with what it holds.
void RemoveUpload(const std::string& folder);

// Removes an upload folder when it goes out of scope. Not thread-safe.
class UploadFolder {
 public:
  explicit UploadFolder(std::string folder) : folder_(std::move(folder)) {}
  ~UploadFolder() {
    if (!folder_.empty()) RemoveUpload(folder_);
  }
  UploadFolder(const UploadFolder&) = delete;
  UploadFolder& operator=(const UploadFolder&) = delete;
  const std::string& path() const { return folder_; }
  // The folder, no longer removed by this object.
  std::string Release() { return std::exchange(folder_, std::string()); }

 private:
  std::string folder_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_UPLOAD_H_
