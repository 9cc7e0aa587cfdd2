#include "engine/large_buffer.h"

#include <sys/mman.h>

#include <new>

namespace mha {

void* AllocateLarge(size_t bytes) {
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePageBytes) madvise(p, rounded, MADV_HUGEPAGE);  // advice: failure is harmless
  return p;
}

}  // namespace mha
