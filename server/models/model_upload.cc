#include "server/models/model_upload.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mha::server {
namespace {

constexpr char kWeights[] = "weights.safetensors";

bool IsVersionFolder(absl::string_view s) {
  if (s.empty() || s.size() > 18 || s[0] == '0') return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

absl::Status WriteFile(const std::string& path, absl::string_view bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("writing ", path, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("writing ", path, ": ", std::strerror(error)));
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("writing ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

constexpr char kAreaPrefix[] = "mha-uploads-";
constexpr char kLockFile[] = "lock";

// Whether `name` is what mkdtemp makes of kAreaPrefix + "XXXXXX".
bool IsAreaName(const std::string& name) {
  const size_t prefix = sizeof(kAreaPrefix) - 1;
  if (name.size() != prefix + 6 || name.compare(0, prefix, kAreaPrefix) != 0) return false;
  for (size_t i = prefix; i < name.size(); ++i) {
    if (!std::isalnum(static_cast<unsigned char>(name[i]))) return false;
  }
  return true;
}

// Removes `folder` when it is an area of a dead server: a real folder of
// this user whose lock file nobody holds. True when removed.
bool RemoveIfAbandoned(const std::string& folder) {
  struct stat info;
  if (lstat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode) || info.st_uid != geteuid()) {
    return false;
  }
  const std::string lock = absl::StrCat(folder, "/", kLockFile);
  const int fd = open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;  // not ours, or a server between mkdtemp and its lock
  const bool abandoned = flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (abandoned) RemoveUpload(folder);
  close(fd);
  return abandoned;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UploadArea>> UploadArea::Create(const std::string& root,
                                                               std::vector<std::string>* removed) {
  std::string base = root;
  if (base.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    base = tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp";
  }
  std::error_code error;
  for (std::filesystem::directory_iterator it(base, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (IsAreaName(name) && RemoveIfAbandoned(it->path().string()) && removed != nullptr) {
      removed->push_back(it->path().string());
    }
  }
  std::string folder = absl::StrCat(base, "/", kAreaPrefix, "XXXXXX");
  if (mkdtemp(folder.data()) == nullptr) {  // mode 0700
    return absl::InternalError(
        absl::StrCat("cannot make a folder in ", base, ": ", std::strerror(errno)));
  }
  // The lock file is locked under another name, then renamed: another
  // server starting beside never finds it unlocked (and so never removes a
  // live server's folder).
  const std::string lock = absl::StrCat(folder, "/", kLockFile);
  const std::string locking = lock + ".new";
  const int fd = open(locking.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0 || rename(locking.c_str(), lock.c_str()) != 0) {
    const int saved = errno;
    if (fd >= 0) close(fd);
    RemoveUpload(folder);
    return absl::InternalError(absl::StrCat("cannot lock ", lock, ": ", std::strerror(saved)));
  }
  return std::unique_ptr<UploadArea>(new UploadArea(std::move(folder), fd));
}

UploadArea::~UploadArea() {
  RemoveUpload(path_);
  close(lock_fd_);
}

absl::Status CheckUploadPath(const std::string& path) {
  const std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
  const bool ok = (parts.size() == 1 && parts[0] == kWeights) ||
                  (parts.size() == 2 && IsVersionFolder(parts[0]) && parts[1] == kWeights);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("file \"", path, "\": a model sent over the API holds ", kWeights,
                   " or <version>/", kWeights, " (version a positive number), nothing else"));
}

absl::StatusOr<std::string> WriteUpload(const std::string& root,
                                        const std::map<std::string, absl::string_view>& files) {
  if (files.empty()) return absl::InvalidArgumentError("no files");
  if (files.size() > kMaxUploadFiles) {
    return absl::InvalidArgumentError(absl::StrCat(
        files.size(), " files; a model sent over the API has at most ", kMaxUploadFiles));
  }
  for (const auto& [path, bytes] : files) {
    if (absl::Status s = CheckUploadPath(path); !s.ok()) return s;
  }
  std::string folder = absl::StrCat(root, "/upload-XXXXXX");
  if (mkdtemp(folder.data()) == nullptr) {  // mode 0700
    return absl::InternalError(
        absl::StrCat("cannot make a folder in ", root, ": ", std::strerror(errno)));
  }
  UploadFolder cleanup(folder);
  for (const auto& [path, bytes] : files) {
    const size_t slash = path.find('/');
    if (slash != std::string::npos) {
      const std::string version = absl::StrCat(folder, "/", path.substr(0, slash));
      if (mkdir(version.c_str(), 0700) != 0 && errno != EEXIST) {
        return absl::InternalError(absl::StrCat("mkdir ", version, ": ", std::strerror(errno)));
      }
    }
    if (absl::Status s = WriteFile(absl::StrCat(folder, "/", path), bytes); !s.ok()) return s;
  }
  return cleanup.Release();  // kept: the load reads it, then removes it
}

void RemoveUpload(const std::string& folder) {
  std::error_code error;
  std::filesystem::remove_all(folder, error);
}

}  // namespace mha::server
