// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for the
// kernels that pack bf16 keys into pairs (flash_bf16_kernels.cc,
// bf16_dot_kernels.cc; a gather per vector ran ~3x slower): inlined into
// each.
#ifndef MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_
#define MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_

#include "engine/ops/intrinsics.h"

namespace mha {

#define MHA_TRANSPOSE_INLINE __attribute__((target("avx512f"), always_inline)) inline

// Transposes 16 rows of 16 u32 in place: a[i][j] becomes a[j][i]. Four
// rounds of in-lane unpacks and 128-bit lane shuffles, 64 shuffles in all.
MHA_TRANSPOSE_INLINE void Transpose16x16(__m512i (&a)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // lane L: a[i][4L], a[i+1][4L], a[i][4L+1], a[i+1][4L+1]
    t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // a[i + c] lane L: column 4L + c of rows i .. i + 3
    a[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    a[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    a[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    a[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of a[c], a[4 + c], a[8 + c], a[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    t[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = t[i];
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_
