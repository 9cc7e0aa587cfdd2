// MHA_MULTIVERSION: a hot loop compiled for AVX-512, AVX2 and the baseline;
// the loader picks the best the CPU has. Plain functions only (clang, the
// fuzz build, cannot clone template instances). Not under ThreadSanitizer:
// the loader runs the (instrumented) resolvers before the TSan runtime
// exists and crashes. Also what the step loops share.
#ifndef MHA_ENGINE_OPS_MULTIVERSION_H_
#define MHA_ENGINE_OPS_MULTIVERSION_H_

#include "engine/sanitizers.h"

#ifdef MHA_TSAN
#define MHA_MULTIVERSION
#else
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

// Bodies shared by several multiversioned functions: inlined into each clone,
// so each is compiled for that clone's instruction set.
#define MHA_INLINE inline __attribute__((always_inline))

namespace mha {

// Fetches the kBytes (a multiple of 64) at `base + offset` into the cache:
// the step loops' lines of the next block (kernels.h), `offset` the bytes
// this block is read at.
template <int kBytes>
__attribute__((always_inline)) inline void FetchNext(const void* base, long offset) {
  static_assert(kBytes % 64 == 0, "whole cache lines");
  const char* at = static_cast<const char*>(base) + offset;
  for (int line = 0; line < kBytes; line += 64) __builtin_prefetch(at + line);
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_MULTIVERSION_H_
