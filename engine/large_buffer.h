// Host memory for large transient buffers (a workspace's scratch, a
// request's converted tensor, a call's outputs). From 2 MiB on, a buffer
// starts on a 2 MiB boundary and is advised MADV_HUGEPAGE: a buffer freed
// after a large call is faulted in again by the next, and a fresh 4 KiB page
// costs microseconds (7 us on a paravirtual guest).
#ifndef MHA_ENGINE_LARGE_BUFFER_H_
#define MHA_ENGINE_LARGE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace mha {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// `bytes` (at least) of uninitialised memory, 64-byte aligned (2 MiB from
// kHugePageBytes on, advised MADV_HUGEPAGE); free it with std::free. Throws
// std::bad_alloc.
void* AllocateLarge(size_t bytes);

struct FreeLarge {
  void operator()(void* p) const { std::free(p); }
};

// What the process keeps of freed transient buffers (LargeArray) at most:
// counted in the server's engine reserve.
inline constexpr size_t kKeptLargeBytes = size_t{64} << 20;

// Transient buffers come and go with every call: glibc maps each one from
// 4 MiB afresh and unmaps it when freed, and the next call zeroes its huge
// pages again (~0.1 ms per 2 MiB here, 0.3-0.6 ms of a 2 MiB call). So a
// freed one from kHugePageBytes up is kept, up to kKeptLargeBytes in all,
// and the next request of at least half its size takes it. A request that
// finds none frees every kept buffer before it allocates: the kept and the
// used buffers together never exceed what the calls used at their peak.
//
// `bytes` (at least) from a kept buffer or AllocateLarge; `*capacity` is the
// buffer's size, to be given back with ReturnLarge. Thread-safe.
void* TakeLarge(size_t bytes, size_t* capacity);
// Keeps `p` (from TakeLarge, `capacity` bytes) for reuse, or frees it.
// Thread-safe.
void ReturnLarge(void* p, size_t capacity);
// Frees every kept buffer (when a retired model version is freed). Thread-safe.
void ReleaseKeptLarge();
// The bytes kept now. Thread-safe.
size_t KeptLargeBytes();

// glibc's malloc thresholds for a process that moves large tensors (the
// server, mha_client, and gRPC's floor in tests/bench/grpc_echo.cc, so that
// the floor is measured as our own processes run): blocks from
// kHeapMmapThreshold on are mappings of their own, unmapped when freed;
// smaller ones come from the arenas, and each arena keeps at most
// kHeapTrimThreshold of free memory at its top. By default glibc maps every
// block from 128 KiB apart, moves the threshold up to the largest block
// freed, and trims an arena once 128 KiB are free at its top: gRPC's
// receive buffers and the tensors of a large call are then faulted in
// afresh at every call (12-18 us per 4 KiB page on a paravirtual guest; a
// bare gRPC echo of 16 MiB each way: 101-117 ms against ~15 ms with these).
inline constexpr int kHeapMmapThreshold = 32 << 20;
inline constexpr int kHeapTrimThreshold = 64 << 20;

// Fixes the thresholds above. Call once, first thing in main.
void SetHeapThresholds();

struct ReturnLargeDeleter {
  size_t capacity = 0;
  void operator()(void* p) const { ReturnLarge(p, capacity); }
};

// `n` uninitialised elements of `T` (trivial types) from TakeLarge, given
// back when destroyed. Not thread-safe.
template <typename T>
class LargeArray {
 public:
  LargeArray() = default;
  explicit LargeArray(size_t n) : size_(n) {
    if (n == 0) return;
    size_t capacity = 0;
    void* p = TakeLarge(n * sizeof(T), &capacity);
    data_ =
        std::unique_ptr<T, ReturnLargeDeleter>(static_cast<T*>(p), ReturnLargeDeleter{capacity});
  }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<T, ReturnLargeDeleter> data_;
  size_t size_ = 0;
};

}  // namespace mha

#endif  // MHA_ENGINE_LARGE_BUFFER_H_
