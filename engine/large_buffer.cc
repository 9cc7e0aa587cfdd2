#include "engine/large_buffer.h"

#include <malloc.h>
#include <sys/mman.h>

#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "engine/mutex.h"

namespace mha {
namespace {

size_t RoundedUp(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }

}  // namespace

void SetHeapThresholds() {
  mallopt(M_MMAP_THRESHOLD, kHeapMmapThreshold);
  mallopt(M_TRIM_THRESHOLD, kHeapTrimThreshold);
}

void* AllocateLarge(size_t bytes) {
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : 64;
  const size_t rounded = RoundedUp(bytes, align);
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePageBytes) madvise(p, rounded, MADV_HUGEPAGE);  // advice: failure is harmless
  return p;
}

namespace {

struct KeptBuffer {
  void* data;
  size_t capacity;
};

// Owns the freed transient buffers kept for reuse (large_buffer.h), oldest
// first. Thread-safe. Buffers are freed outside its lock.
class KeptBuffers {
 public:
  // The smallest kept buffer of `bytes` to twice that, taken out; or none,
  // and then every kept buffer is handed to `*dropped`.
  std::optional<KeptBuffer> Take(size_t bytes, std::vector<KeptBuffer>* dropped) {
    MutexLock lock(mu_);
    size_t best = kept_.size();
    for (size_t i = 0; i < kept_.size(); ++i) {
      const size_t c = kept_[i].capacity;
      if (c >= bytes && c / 2 <= bytes && (best == kept_.size() || c < kept_[best].capacity)) {
        best = i;
      }
    }
    if (best == kept_.size()) {
      dropped->swap(kept_);
      bytes_ = 0;
      return std::nullopt;
    }
    const KeptBuffer found = kept_[best];
    kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
    bytes_ -= found.capacity;
    return found;
  }

  // Keeps `buffer`, handing the oldest buffers beyond kKeptLargeBytes to
  // `*dropped`.
  void Keep(KeptBuffer buffer, std::vector<KeptBuffer>* dropped) {
    MutexLock lock(mu_);
    kept_.push_back(buffer);
    bytes_ += buffer.capacity;
    size_t oldest = 0;
    while (bytes_ > kKeptLargeBytes) {
      dropped->push_back(kept_[oldest]);
      bytes_ -= kept_[oldest++].capacity;
    }
    kept_.erase(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(oldest));
  }

  std::vector<KeptBuffer> TakeAll() {
    MutexLock lock(mu_);
    bytes_ = 0;
    return std::exchange(kept_, {});
  }

  size_t bytes() {
    MutexLock lock(mu_);
    return bytes_;
  }

 private:
  Mutex mu_;
  std::vector<KeptBuffer> kept_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

KeptBuffers& Kept() {
  static KeptBuffers* const kept = new KeptBuffers();  // never destroyed: frees may come at exit
  return *kept;
}

void FreeAll(const std::vector<KeptBuffer>& buffers) {
  for (const KeptBuffer& b : buffers) std::free(b.data);
}

}  // namespace

void* TakeLarge(size_t bytes, size_t* capacity) {
  if (bytes < kHugePageBytes || bytes > kKeptLargeBytes) {
    *capacity = bytes;
    return AllocateLarge(bytes);
  }
  std::vector<KeptBuffer> dropped;
  if (const std::optional<KeptBuffer> kept = Kept().Take(bytes, &dropped)) {
    *capacity = kept->capacity;
    return kept->data;
  }
  FreeAll(dropped);  // before the new buffer: never more than the calls' peak
  *capacity = RoundedUp(bytes, kHugePageBytes);
  return AllocateLarge(*capacity);
}

void ReturnLarge(void* p, size_t capacity) {
  if (p == nullptr) return;
  if (capacity < kHugePageBytes || capacity > kKeptLargeBytes) {
    std::free(p);
    return;
  }
  std::vector<KeptBuffer> dropped;
  Kept().Keep(KeptBuffer{p, capacity}, &dropped);
  FreeAll(dropped);
}

void ReleaseKeptLarge() { FreeAll(Kept().TakeAll()); }

size_t KeptLargeBytes() { return Kept().bytes(); }

}  // namespace mha
