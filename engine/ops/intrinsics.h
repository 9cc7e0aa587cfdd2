// <immintrin.h> for the kernels' files. GCC 12's AVX-512 headers trip its
// own uninitialised-value warnings (their _mm512_undefined_* placeholders),
// so those two warnings are off in the files that include this one; nothing
// of ours is uninitialised.
#ifndef MHA_ENGINE_OPS_INTRINSICS_H_
#define MHA_ENGINE_OPS_INTRINSICS_H_

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#endif  // MHA_ENGINE_OPS_INTRINSICS_H_
