// A model sent over the API (Triton's RepositoryModelLoad with `file:`
// parameters): its files, checked and written to a private folder that the
// load reads and then removes.
#ifndef MHA_SERVER_MODELS_MODEL_UPLOAD_H_
#define MHA_SERVER_MODELS_MODEL_UPLOAD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

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

// The server's own folder for uploads: "mha-uploads-XXXXXX" (mode 0700)
// under a base folder, with a file "lock" this object holds locked
// (flock) while it lives. Made at start, after removing every such folder
// whose lock nobody holds (its server died without removing it): only
// folders of that name, owned by this user, with that lock file; never a
// symbolic link, never another process's files. Removed with what it
// holds when destroyed. Owns the folder and the lock; immutable, so
// thread-safe.
class UploadArea {
 public:
  // Under `base` ("": $TMPDIR or /tmp). `removed` gets the folders of dead
  // servers that were removed.
  static absl::StatusOr<std::unique_ptr<UploadArea>> Create(const std::string& base,
                                                            std::vector<std::string>* removed);
  ~UploadArea();
  UploadArea(const UploadArea&) = delete;
  UploadArea& operator=(const UploadArea&) = delete;
  const std::string& path() const { return path_; }

 private:
  UploadArea(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  const std::string path_;
  const int lock_fd_;
};

// Writes `files` (relative path -> bytes, each path checked first: nothing
// is written when one is refused) to a new folder, mode 0700, under `root`
// (an UploadArea's path), and returns the folder. Files are created, never
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
