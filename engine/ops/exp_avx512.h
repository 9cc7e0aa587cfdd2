// The AVX-512 softmax's exp and tail masks, shared by the files whose
// kernels compute it (avx512_kernels.cc, flash_bf16_kernels.cc): inlined
// into each, so every one computes the same polynomial.
#ifndef MHA_ENGINE_OPS_EXP_AVX512_H_
#define MHA_ENGINE_OPS_EXP_AVX512_H_

#include <cstdint>
#include <iterator>

#include "engine/ops/exp_polynomial.h"
#include "engine/ops/intrinsics.h"

namespace mha {

#define MHA_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline

// The first `left` of 16 lanes (none when `left` <= 0).
MHA_AVX512_INLINE __mmask16 TailLanes(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for x <= 0; NaN stays NaN. kAccurate: ~2 ulp (the degree-6
// polynomial of the portable f32 exp); otherwise ~4e-6 relative (degree 4,
// for probabilities that are rounded to bf16).
template <bool kAccurate>
MHA_AVX512_INLINE __m512 ExpNonPositive(__m512 x) {
  // -inf (a masked key) and anything below -1000 become -1000, whose 2^n
  // below scales to exactly 0. vmaxps returns its second operand when
  // either is NaN: NaN goes through and comes out NaN.
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-1000.0f), x);
  // exp(c) = 2^n * exp(r), n = round(c / ln 2), r = c - n ln 2 (two steps,
  // exact products for |n| < 2^15); vscalefps underflows to denormals and 0.
  namespace c = exp_polynomial;
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(c::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2High), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2Low), r);
  constexpr const float* kCoefficients = kAccurate ? c::kAccurate : c::kBf16;
  constexpr int kTerms = kAccurate ? std::size(c::kAccurate) : std::size(c::kBf16);
  __m512 p = _mm512_set1_ps(kCoefficients[0]);
  for (int i = 1; i < kTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoefficients[i]));
  if constexpr (kAccurate) {  // p r^2 + r + 1, adding the large terms last
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  }
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 to ~3e-6 relative (kExp2Bf16); exact 0 for -inf and
// below -200, NaN for NaN.
MHA_AVX512_INLINE __m512 Exp2NonPositive(__m512 x) {
  // vmaxps returns its second operand when either is NaN.
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  namespace c = exp_polynomial;
  __m512 p = _mm512_set1_ps(c::kExp2Bf16[0]);
  for (size_t i = 1; i < std::size(c::kExp2Bf16); ++i) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c::kExp2Bf16[i]));
  }
  return _mm512_scalef_ps(p, n);
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_EXP_AVX512_H_
