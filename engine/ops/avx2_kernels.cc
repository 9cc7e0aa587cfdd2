// The softmax's exp-and-sum in AVX2 intrinsics (KernelIsa::kAvx2): the
// portable loop's polynomials and range (0 below -87, NaN kept), eight
// lanes at a time in two independent chains, where the compiled portable
// loop runs one chain and spends as long on its range checks and exponent
// assembly as on the polynomial.
#include <cstdint>
#include <iterator>

#include "engine/ops/avx512_kernels.h"
#include "engine/ops/exp_polynomial.h"
#include "engine/ops/intrinsics.h"

namespace mha {
namespace {

#define MHA_AVX2 __attribute__((target("avx2,fma")))

// exp(x) for x <= 0 (the row minus its maximum): 0 below -87 (and for
// -inf), NaN for NaN. kAccurate: the degree-6 polynomial (~2 ulp);
// otherwise degree 4 (~4e-6 relative, for probabilities rounded to bf16).
template <bool kAccurate>
MHA_AVX2 inline __m256 ExpNonPositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.0f);
  // vmaxps returns its second operand when either is NaN: NaN goes through.
  const __m256 clamped = _mm256_max_ps(floor, x);
  namespace c = exp_polynomial;
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(c::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2High), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2Low), r);
  constexpr const float* kCoefficients = kAccurate ? c::kAccurate : c::kBf16;
  constexpr int kTerms = kAccurate ? std::size(c::kAccurate) : std::size(c::kBf16);
  __m256 p = _mm256_set1_ps(kCoefficients[0]);
  for (int i = 1; i < kTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoefficients[i]));
  if constexpr (kAccurate) {  // p r^2 + r + 1, adding the large terms last
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  }
  // 2^n for n in [-126, 0] (NaN lanes give some scale: p is NaN there).
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ), e);  // below -87: 0
}

// The first `count` (< 8) lanes set, for maskload / maskstore.
MHA_AVX2 inline __m256i FirstLanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <bool kAccurate>
MHA_AVX2 float ExpSumOf(float* row, int64_t cols, float max) {
  const __m256 row_max = _mm256_set1_ps(max);
  __m256 sum = _mm256_setzero_ps(), sum2 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= cols; j += 16) {
    const __m256 e = ExpNonPositive<kAccurate>(_mm256_sub_ps(_mm256_loadu_ps(row + j), row_max));
    const __m256 e2 =
        ExpNonPositive<kAccurate>(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), row_max));
    _mm256_storeu_ps(row + j, e);
    _mm256_storeu_ps(row + j + 8, e2);
    sum = _mm256_add_ps(sum, e);
    sum2 = _mm256_add_ps(sum2, e2);
  }
  for (; j < cols; j += 8) {
    const __m256i lanes = FirstLanes(cols - j);
    // Lanes past the row load 0 and are masked out of the sum and the store.
    const __m256 e = _mm256_and_ps(
        _mm256_castsi256_ps(lanes),
        ExpNonPositive<kAccurate>(_mm256_sub_ps(_mm256_maskload_ps(row + j, lanes), row_max)));
    _mm256_maskstore_ps(row + j, lanes, e);
    sum = _mm256_add_ps(sum, e);
  }
  sum = _mm256_add_ps(sum, sum2);
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

}  // namespace

float ExpSumAvx2(float* row, int64_t cols, float max) { return ExpSumOf<false>(row, cols, max); }

float ExpSumAccurateAvx2(float* row, int64_t cols, float max) {
  return ExpSumOf<true>(row, cols, max);
}

}  // namespace mha
