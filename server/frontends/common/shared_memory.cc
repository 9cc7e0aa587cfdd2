#include "server/frontends/common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mha::server {
namespace {

absl::Status ErrnoStatus(int error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InvalidArgumentError(message);
  }
}

// POSIX's portable form: one leading '/', no other, at most NAME_MAX.
bool ValidKey(const std::string& key) {
  return key.size() >= 2 && key.size() <= 255 && key[0] == '/' &&
         key.find('/', 1) == std::string::npos && key.find('\0') == std::string::npos;
}

}  // namespace

SharedMemoryFile::~SharedMemoryFile() { close(fd_); }

absl::Status SharedMemorySlice::Read(absl::Span<uint8_t> out) const {
  uint64_t done = 0;
  while (done < out.size()) {
    const ssize_t n = pread(region.file->fd(), out.data() + done, out.size() - done,
                            static_cast<off_t>(region.offset + offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrCat("reading region ", region.name));
    if (n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("region ", region.name, ": its object '", region.key,
                       "' is now shorter than registered; register it again"));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SharedMemorySlice::Write(absl::Span<const uint8_t> data) const {
  if (data.size() > byte_size) {
    return absl::InternalError("a shared-memory output larger than its slice");
  }
  uint64_t done = 0;
  while (done < data.size()) {
    const ssize_t n = pwrite(region.file->fd(), data.data() + done, data.size() - done,
                             static_cast<off_t>(region.offset + offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus(errno, absl::StrCat("writing region ", region.name));
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Register(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("name: required");
  if (!ValidKey(key)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key '", key, "': a POSIX shared-memory name, '/' then at most 254 characters, no '/'"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be positive");
  if (offset > (uint64_t{1} << 62) || byte_size > (uint64_t{1} << 62)) {
    return absl::InvalidArgumentError("offset and byte_size: too large");
  }
  {
    MutexLock lock(mu_);
    if (regions_.count(name) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region ", name, " is registered"));
    }
    if (regions_.size() >= max_regions_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(max_regions_, " regions are registered: unregister one first"));
    }
  }
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening shared memory '", key, "'"));
  auto file = std::make_shared<const SharedMemoryFile>(fd);
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat of '", key, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("'", key, "' is not a shared-memory object"));
  }
  if (static_cast<uint64_t>(st.st_size) < offset + byte_size) {
    return absl::InvalidArgumentError(absl::StrCat("'", key, "' holds ", st.st_size,
                                                   " bytes, fewer than offset ", offset,
                                                   " + byte_size ", byte_size));
  }
  MutexLock lock(mu_);
  auto [it, inserted] =
      regions_.emplace(name, SharedMemoryRegion{name, key, offset, byte_size, std::move(file)});
  if (!inserted) return absl::AlreadyExistsError(absl::StrCat("region ", name, " is registered"));
  return absl::OkStatus();
}

void SharedMemoryRegistry::Unregister(const std::string& name) {
  MutexLock lock(mu_);
  if (name.empty()) {
    regions_.clear();
  } else {
    regions_.erase(name);
  }
}

absl::StatusOr<std::vector<SharedMemoryRegion>> SharedMemoryRegistry::Status(
    const std::string& name) const {
  MutexLock lock(mu_);
  std::vector<SharedMemoryRegion> out;
  if (name.empty()) {
    for (const auto& [n, region] : regions_) out.push_back(region);
    return out;
  }
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no shared-memory region ", name, " is registered"));
  }
  out.push_back(it->second);
  return out;
}

absl::StatusOr<SharedMemorySlice> SharedMemoryRegistry::Slice(const std::string& name,
                                                              uint64_t offset, uint64_t byte_size,
                                                              const std::string& what) const {
  SharedMemoryRegion region;
  {
    MutexLock lock(mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no shared-memory region ", name, " is registered"));
    }
    region = it->second;
  }
  if (offset > region.byte_size || byte_size > region.byte_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shared_memory_offset ", offset, " + shared_memory_byte_size ", byte_size,
        " is past the end of region ", name, " (", region.byte_size, " bytes)"));
  }
  return SharedMemorySlice{std::move(region), offset, byte_size};
}

}  // namespace mha::server
