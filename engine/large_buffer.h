// Host memory for large transient buffers (a workspace's scratch, a
// request's converted tensor, a response's bytes). From 2 MiB on, a buffer
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

// `n` uninitialised elements of `T` (trivial types) from AllocateLarge.
template <typename T>
class LargeArray {
 public:
  LargeArray() = default;
  explicit LargeArray(size_t n)
      : data_(static_cast<T*>(n == 0 ? nullptr : AllocateLarge(n * sizeof(T)))), size_(n) {}

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<T, FreeLarge> data_;
  size_t size_ = 0;
};

}  // namespace mha

#endif  // MHA_ENGINE_LARGE_BUFFER_H_
