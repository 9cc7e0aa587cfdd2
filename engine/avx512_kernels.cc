#include "engine/avx512_kernels.h"

// GCC 12's AVX-512 headers trip its own uninitialised-value warnings
// (their _mm512_undefined_* placeholders); nothing of ours is uninitialised.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

namespace mha {

bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

__attribute__((target("avx512f"))) float ExpSumAvx512(float* row, int64_t cols, float max) {
  const __m512 row_max = _mm512_set1_ps(max);
  const __m512 low = _mm512_set1_ps(-87.0f);
  const __m512 zero = _mm512_setzero_ps();
  __m512 sum = zero;
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 lanes =
        cols - j >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (cols - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + j), row_max);
    // vmaxps returns its second operand for NaN: NaN is restored below.
    const __m512 clamped = _mm512_max_ps(x, low);
    // exp(c) = 2^n * exp(r), n = round(c / ln 2), r = c - n ln 2 (two steps).
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(4.15898298e-2f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.67906357e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00022231e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.99963654e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 e = _mm512_scalef_ps(p, n);
    e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), e, zero);
    e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);
    _mm512_mask_storeu_ps(row + j, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512f"))) void ScaleToBf16Avx512(const float* in, float scale,
                                                          uint16_t* out, int64_t count) {
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes =
        count - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m512i bits =
        _mm512_castps_si512(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, in + i), factor));
    // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the top half.
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, odd)), 16);
    _mm512_mask_cvtepi32_storeu_epi16(out + i, lanes, rounded);
  }
}

}  // namespace mha
