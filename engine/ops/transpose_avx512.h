// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, and the loads
// of bf16 pairs around it, for the kernels that pack keys into pairs (flash_bf16_kernels.cc,
// bf16_dot_kernels.cc; a gather per vector ran ~3x slower): inlined into
// each.
#ifndef MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_
#define MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_

#include <cstdint>

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

// Pairs p0 .. p0 + 15 (fewer past `pairs`) of 16 bf16 rows `stride` apart,
// rows from `rows` on read as zeros, transposed: a[m] holds pair p0 + m of
// row j in lane j. Whole rows by plain loads (masked ones cost ~25 % more
// on the EPYC VM, every lane set or not).
MHA_TRANSPOSE_INLINE void LoadPairsTransposed(const uint16_t* k, int64_t stride, int64_t rows,
                                              int64_t pairs, int64_t p0, __m512i (&a)[16]) {
  const int64_t left = pairs - p0;
  const __mmask16 lanes = left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const uint16_t* row = k + r * stride + 2 * p0;
    a[r] = r >= rows         ? _mm512_setzero_si512()
           : lanes == 0xffff ? _mm512_loadu_si512(row)
                             : _mm512_maskz_loadu_epi32(lanes, row);
  }
  Transpose16x16(a);
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_TRANSPOSE_AVX512_H_
