// The int8 projections' conversions (LinearLayer's kInt8): rows quantized
// to u8 before the product, its s32 sums turned back into f32 or bf16 after
// it. In AVX-512 intrinsics where the CPU has them (HasAvx512), else
// portable loops that round the same way.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/bf16_rows.h"
#include "engine/ops/intrinsics.h"
#include "engine/ops/kernels.h"
#include "engine/ops/parallel_for.h"

namespace mha {
namespace {

// Rows are shared across threads from this many elements on.
constexpr int64_t kParallelElements = 64 << 10;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The scale of a row whose largest |value| is `max` (`bad`: it holds inf or
// NaN), and what its values are multiplied by before rounding.
struct RowScale {
  float scale, inverse;
};
inline RowScale ScaleOf(float max, bool bad) {
  if (bad) return {kNaN, 0.0f};
  if (max == 0.0f) return {0.0f, 0.0f};
  return {max / 127.0f, 127.0f / max};
}

// ---- portable --------------------------------------------------------------

inline float ValueAt(const void* row, bool bf16, int64_t c) {
  if (bf16) return Bf16ToFloat(static_cast<const uint16_t*>(row)[c]);
  return static_cast<const float*>(row)[c];
}

float QuantizeRowPortable(const void* x, bool bf16, int64_t k, uint8_t* out) {
  float max = 0.0f;
  bool bad = false;
  for (int64_t c = 0; c < k; ++c) {
    const float a = std::fabs(ValueAt(x, bf16, c));
    bad |= !(a <= std::numeric_limits<float>::max());
    max = std::max(max, a);
  }
  const RowScale s = ScaleOf(max, bad);
  if (bad) {  // its scale is NaN: its values do not matter (and NaN has none)
    std::memset(out, 128, k);
    return s.scale;
  }
  for (int64_t c = 0; c < k; ++c) {
    const float q = std::nearbyint(ValueAt(x, bf16, c) * s.inverse);
    out[c] = static_cast<uint8_t>(std::clamp(q, -127.0f, 127.0f) + 128.0f);
  }
  return s.scale;
}

void DequantizeRowPortable(const int32_t* sums, int64_t n, float row_scale,
                           const Int8Dequantization& d, float* out) {
  for (int64_t c = 0; c < n; ++c) {
    const float sum = static_cast<float>(sums[c] - d.offset_share[c]);
    out[c] = sum * (row_scale * d.col_scales[c]) + d.bias[c];
  }
}

// ---- AVX-512 ---------------------------------------------------------------

#define MHA_AVX512_INT8 __attribute__((target("avx512f,avx512bw,avx512vl")))

MHA_AVX512_INT8 inline __mmask16 Lanes(int64_t left) {
  return left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1);
}

// 16 values (fewer at the tail: the others 0) of an f32 or bf16 row.
// All 16 by a plain load: masked loads cost ~25 % more on the EPYC VM.
MHA_AVX512_INT8 inline __m512 Load16(const void* row, bool bf16, int64_t c, __mmask16 lanes) {
  const bool all = lanes == 0xffff;
  if (bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    const __m256i h = all ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                          : _mm256_maskz_loadu_epi16(lanes, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  const float* p = static_cast<const float*>(row) + c;
  return all ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes, p);
}

MHA_AVX512_INT8 float QuantizeRowAvx512(const void* x, bool bf16, int64_t k, uint8_t* out) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 max = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t c = 0; c < k; c += 16) {
    const __m512 a = _mm512_abs_ps(Load16(x, bf16, c, Lanes(k - c)));
    bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // inf or NaN
    max = _mm512_max_ps(max, a);
  }
  const RowScale s = ScaleOf(_mm512_reduce_max_ps(max), bad != 0);
  if (bad != 0) {  // as the portable loop
    std::memset(out, 128, k);
    return s.scale;
  }
  const __m512 inverse = _mm512_set1_ps(s.inverse);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 lanes = Lanes(k - c);
    // Rounded to nearest even (the default MXCSR mode), within [-127, 127].
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(Load16(x, bf16, c, lanes), inverse));
    q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(q, offset));
    if (lanes == 0xffff) {  // a plain store: masked ones cost more, all lanes set or not
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), bytes);
    } else {
      _mm_mask_storeu_epi8(out + c, lanes, bytes);
    }
  }
  return s.scale;
}

}  // namespace

void QuantizeRowsU8(const void* x, bool bf16, int64_t rows, int64_t k, uint8_t* out,
                    float* scales) {
  const bool avx512 = HasAvx512();
  const int64_t row_bytes = k * (bf16 ? 2 : 4);
  ForRange(rows, rows * k >= kParallelElements, [&](int64_t r) {
    const void* row = static_cast<const uint8_t*>(x) + r * row_bytes;
    scales[r] = avx512 ? QuantizeRowAvx512(row, bf16, k, out + r * k)
                       : QuantizeRowPortable(row, bf16, k, out + r * k);
  });
}

void DequantizeRows(int32_t* sums, int64_t rows, int64_t n, const Int8Dequantization& d, bool bf16,
                    void* y) {
  const bool avx512 = HasAvx512();
  const int64_t row_bytes = n * (bf16 ? 2 : 4);
  ForRange(rows, rows * n >= kParallelElements, [&](int64_t r) {
    int32_t* row_sums = sums + r * n;
    void* out = static_cast<uint8_t*>(y) + r * row_bytes;
    if (avx512) {
      DequantizeRowAvx512(row_sums, n, d.row_scales[r], d.col_scales, d.offset_share, d.bias, bf16,
                          out);
      return;
    }
    // f32 results in place of the sums (the same size), then to bf16.
    float* f32 = bf16 ? reinterpret_cast<float*>(row_sums) : static_cast<float*>(out);
    DequantizeRowPortable(row_sums, n, d.row_scales[r], d, f32);
    if (bf16) ScaleToBf16(f32, 1.0f, static_cast<uint16_t*>(out), n);
  });
}

}  // namespace mha
