// Triton's system shared memory: POSIX shared-memory objects a same-host
// client registers by name, which requests then name for their inputs and
// outputs instead of carrying the bytes in the message.
#ifndef MHA_SERVER_FRONTENDS_SHARED_MEMORY_H_
#define MHA_SERVER_FRONTENDS_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/mutex.h"

namespace mha::server {

// An open descriptor of a shared-memory object, closed with the last
// region or request that uses it. Thread-safe (pread/pwrite only).
class SharedMemoryFile {
 public:
  explicit SharedMemoryFile(int fd) : fd_(fd) {}
  ~SharedMemoryFile();
  SharedMemoryFile(const SharedMemoryFile&) = delete;
  SharedMemoryFile& operator=(const SharedMemoryFile&) = delete;
  int fd() const { return fd_; }

 private:
  const int fd_;
};

// A registered region: `byte_size` bytes at `offset` of the object `key`.
// A copy keeps the object open, so a request that found a region finishes
// with it even if it is unregistered meanwhile.
struct SharedMemoryRegion {
  std::string name, key;
  uint64_t offset = 0, byte_size = 0;
  std::shared_ptr<const SharedMemoryFile> file;
};

// `byte_size` bytes at `offset` within a region, as a request names them.
struct SharedMemorySlice {
  SharedMemoryRegion region;
  uint64_t offset = 0, byte_size = 0;

  // The slice's bytes into `out` (byte_size of them), read with pread, so
  // an object the client shrank is an error here, never a fault.
  absl::Status Read(absl::Span<uint8_t> out) const;
  // `data` (at most byte_size bytes) written at the slice's start.
  absl::Status Write(absl::Span<const uint8_t> data) const;
};

// Owns the registered regions (name -> region). The objects are read and
// written with pread/pwrite, never mapped: a client that truncates its
// object after registering it gets an error, not a server killed by
// SIGBUS. Thread-safe.
class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(size_t max_regions = 1024) : max_regions_(max_regions) {}

  // Opens the POSIX shared-memory object `key` ("/name") read-write and
  // checks that it holds offset + byte_size bytes. ALREADY_EXISTS for a
  // name in use; NOT_FOUND for no such object; INVALID_ARGUMENT for a bad
  // name, key, range or object; RESOURCE_EXHAUSTED beyond max_regions.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);
  // Forgets the region (every region when `name` is empty); requests
  // already holding it finish with it. An unknown name is not an error.
  void Unregister(const std::string& name);
  // The region `name`, or every region when it is empty; NOT_FOUND for an
  // unknown name.
  absl::StatusOr<std::vector<SharedMemoryRegion>> Status(const std::string& name) const;
  // `byte_size` bytes at `offset` of region `name`, checked to lie within
  // it. INVALID_ARGUMENT naming `what` otherwise.
  absl::StatusOr<SharedMemorySlice> Slice(const std::string& name, uint64_t offset,
                                          uint64_t byte_size, const std::string& what) const;

 private:
  const size_t max_regions_;
  mutable Mutex mu_;
  std::map<std::string, SharedMemoryRegion> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_SHARED_MEMORY_H_
