// MHA_MULTIVERSION: a hot loop compiled for AVX-512, AVX2 and the baseline;
// the loader picks the best the CPU has. Plain functions only (clang, the
// fuzz build, cannot clone template instances). Not under ThreadSanitizer:
// the loader runs the (instrumented) resolvers before the TSan runtime
// exists and crashes.
#ifndef MHA_ENGINE_OPS_MULTIVERSION_H_
#define MHA_ENGINE_OPS_MULTIVERSION_H_

#if defined(__SANITIZE_THREAD__)
#define MHA_MULTIVERSION
#else
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

#endif  // MHA_ENGINE_OPS_MULTIVERSION_H_
