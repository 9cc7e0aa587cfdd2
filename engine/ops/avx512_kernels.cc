#include "engine/ops/avx512_kernels.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iterator>
#include <limits>

#include "engine/ops/exp_avx512.h"
#include "engine/ops/intrinsics.h"

namespace mha {

namespace {

// The templates below carry the bf16 target for their native instances;
// the others use plain AVX-512 intrinsics only (GCC 12 and clang 14 never
// emit bf16 instructions on their own).
#define MHA_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

std::atomic<KernelIsa> isa_cap{KernelIsa::kAvx512Bf16};

KernelIsa DetectIsa() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl")) {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return avx2 ? KernelIsa::kAvx2 : KernelIsa::kPortable;
  }
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // leaf 7, subleaf 1: EAX bit 5
  const bool bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5)) != 0;
  return bf16 ? KernelIsa::kAvx512Bf16 : KernelIsa::kAvx512;
}

// Stores v as bf16, rounded to nearest even, NaN kept quiet. kNative: the
// AVX512-BF16 conversion (one instruction; denormals become 0). Otherwise
// dtype.h's FloatToBf16 in integer steps: add 0x7fff plus the lowest kept
// bit and keep the top half, except NaN lanes, whose top half is kept with
// the quiet bit set (the sum could carry a NaN into another value).
// kFull: all 16 lanes, by a plain store (on the EPYC VM a dequantize loop
// with every lane set ran 4 % slower with a masked store, 25 % with masked
// loads).
template <bool kNative, bool kFull = false>
MHA_AVX512_BF16 inline void StoreBf16(uint16_t* out, __mmask16 lanes, __m512 v) {
  if constexpr (kNative && kFull) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  } else if constexpr (kNative) {
    _mm256_mask_storeu_epi16(out, lanes, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i top = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, top, _mm512_set1_epi32(0x40));
    if constexpr (kFull) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
    } else {
      _mm512_mask_cvtepi32_storeu_epi16(out, lanes, rounded);
    }
  }
}

// What ExpSumOf computes and where it writes it: back into the f32 row
// (with the ~2 ulp exp of f32 probabilities, or the cheap one), or as bf16
// (with the native conversion or the integer one).
enum class ExpOut { kF32Accurate, kF32, kBf16Native, kBf16Integer };

template <ExpOut kOut>
MHA_AVX512_BF16 inline void StoreExp(float* f32, uint16_t* bf16, int64_t j, __mmask16 lanes,
                                     __m512 e) {
  if constexpr (kOut == ExpOut::kF32 || kOut == ExpOut::kF32Accurate) {
    _mm512_mask_storeu_ps(f32 + j, lanes, e);
  } else {
    StoreBf16<kOut == ExpOut::kBf16Native>(bf16 + j, lanes, e);
  }
}

// exp(row[j] - max) to f32_out or bf16_out, returning their sum. Full
// vectors two at a time: two independent chains keep the core busy (one
// chain left it waiting on each exp's latency, 1.2x slower).
template <ExpOut kOut>
MHA_AVX512_BF16 float ExpSumOf(const float* row, int64_t cols, float max, float* f32_out,
                               uint16_t* bf16_out) {
  constexpr bool kAccurate = kOut == ExpOut::kF32Accurate;
  const __m512 row_max = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps(), sum2 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= cols; j += 32) {
    const __m512 e = ExpNonPositive<kAccurate>(_mm512_sub_ps(_mm512_loadu_ps(row + j), row_max));
    const __m512 e2 =
        ExpNonPositive<kAccurate>(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16), row_max));
    StoreExp<kOut>(f32_out, bf16_out, j, 0xffff, e);
    StoreExp<kOut>(f32_out, bf16_out, j + 16, 0xffff, e2);
    sum = _mm512_add_ps(sum, e);
    sum2 = _mm512_add_ps(sum2, e2);
  }
  for (; j < cols; j += 16) {
    const __mmask16 lanes = TailLanes(cols - j);
    const __m512 e =
        ExpNonPositive<kAccurate>(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + j), row_max));
    StoreExp<kOut>(f32_out, bf16_out, j, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum, sum2));
}

template <bool kNative>
MHA_AVX512_BF16 void ScaleToBf16Of(const float* in, float scale, uint16_t* out, int64_t count) {
  const __m512 factor = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    StoreBf16<kNative, true>(out + i, 0xffff, _mm512_mul_ps(_mm512_loadu_ps(in + i), factor));
  }
  if (i < count) {
    const __mmask16 lanes = TailLanes(count - i);
    StoreBf16<kNative>(out + i, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, in + i), factor));
  }
}

// DequantizeRowAvx512's loop, the output f32 or bf16 (kBf16, kNative: by
// AVX512-BF16's conversion).
template <bool kBf16, bool kNative>
MHA_AVX512_BF16 void DequantizeRowOf(const int32_t* sums, int64_t n, float row_scale,
                                     const float* col_scales, const int32_t* offset_share,
                                     const float* bias, void* out) {
  const __m512 rs = _mm512_set1_ps(row_scale);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {  // plain loads and stores
    const __m512i s =
        _mm512_sub_epi32(_mm512_loadu_si512(sums + c), _mm512_loadu_si512(offset_share + c));
    const __m512 scale = _mm512_mul_ps(rs, _mm512_loadu_ps(col_scales + c));
    const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, _mm512_loadu_ps(bias + c));
    if constexpr (kBf16) {
      StoreBf16<kNative, true>(static_cast<uint16_t*>(out) + c, 0xffff, y);
    } else {
      _mm512_storeu_ps(static_cast<float*>(out) + c, y);
    }
  }
  if (c == n) return;
  const __mmask16 lanes = TailLanes(n - c);  // the tail, masked
  const __m512i s = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(lanes, sums + c),
                                     _mm512_maskz_loadu_epi32(lanes, offset_share + c));
  const __m512 scale = _mm512_mul_ps(rs, _mm512_maskz_loadu_ps(lanes, col_scales + c));
  const __m512 y =
      _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, _mm512_maskz_loadu_ps(lanes, bias + c));
  if constexpr (kBf16) {
    StoreBf16<kNative>(static_cast<uint16_t*>(out) + c, lanes, y);
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + c, lanes, y);
  }
}

// SoftmaxShortRowsAvx512 for up to 4 rows of NV vectors of scores, in
// registers, each step for all rows before the next (one row alone left the
// core waiting on each reduction's latency): the masks added, the max (NaN
// scores never become it), the exps summed in ExpSumOf's order (pairs of
// full vectors into two sums, the rest into the first), then normalised as
// SoftmaxRow does.
template <int NV, bool kBf16Only, bool kNative>
MHA_AVX512_BF16 void SoftmaxShortRowsOf(const ShortSoftmaxRow* rows, int n, int64_t cols,
                                        const float* add_a, int64_t masked) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const __m512 neg_inf = _mm512_set1_ps(-kInf);
  __m512 x[kShortSoftmaxRows][NV];
  __mmask16 lanes[NV];
  float max[kShortSoftmaxRows];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) lanes[v] = TailLanes(cols - 16 * v);
#pragma GCC unroll 4
  for (int r = 0; r < kShortSoftmaxRows; ++r) {
    if (r >= n) break;
    __m512 row_max = neg_inf;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int64_t j = 16 * v;
      const __mmask16 in_masked = TailLanes(masked - j);
      __m512 y = _mm512_maskz_loadu_ps(lanes[v], rows[r].scores + j);
      if (add_a != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(in_masked, add_a + j));
      if (rows[r].add_b != nullptr) {
        y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(in_masked, rows[r].add_b + j));
      }
      const __mmask16 hidden =
          in_masked & static_cast<__mmask16>(~TailLanes(rows[r].causal_limit - j));
      x[r][v] = _mm512_mask_mov_ps(y, hidden, neg_inf);
      row_max = _mm512_mask_max_ps(row_max, lanes[v], x[r][v], row_max);  // NaN keeps row_max
    }
    max[r] = _mm512_reduce_max_ps(row_max);
  }
  float sum[kShortSoftmaxRows];
#pragma GCC unroll 4
  for (int r = 0; r < kShortSoftmaxRows; ++r) {
    if (r >= n) break;
    const __m512 m = _mm512_set1_ps(max[r]);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      x[r][v] = ExpNonPositive<!kBf16Only>(_mm512_sub_ps(x[r][v], m));
      const bool full_pair = 16 * (v | 1) + 16 <= cols;  // ExpSumOf's loop of 32
      if (full_pair && v % 2 == 1) {
        odd = _mm512_add_ps(odd, x[r][v]);
      } else if (full_pair) {
        even = _mm512_add_ps(even, x[r][v]);
      } else {
        even = _mm512_mask_add_ps(even, lanes[v], even, x[r][v]);
      }
    }
    sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
#pragma GCC unroll 4
  for (int r = 0; r < kShortSoftmaxRows; ++r) {
    if (r >= n) break;
    const ShortSoftmaxRow& row = rows[r];
    if (!(max[r] < kInf) || max[r] == -kInf) {
      // As SoftmaxRow: every key masked gives zeros, overflowed scores NaN.
      const bool nan = max[r] != -kInf;
      for (int64_t j = 0; j < cols; ++j) row.scores[j] = nan ? std::nanf("") : 0.0f;
      for (int64_t j = 0; row.bf16 != nullptr && j < cols; ++j) row.bf16[j] = nan ? 0x7fc0 : 0;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 p = _mm512_mul_ps(x[r][v], inv);
      _mm512_mask_storeu_ps(row.scores + 16 * v, lanes[v], kBf16Only ? x[r][v] : p);
      if (row.bf16 != nullptr) StoreBf16<kNative>(row.bf16 + 16 * v, lanes[v], p);
    }
  }
}

template <bool kBf16Only, bool kNative>
MHA_AVX512_BF16 void SoftmaxShortRowsIn(const ShortSoftmaxRow* rows, int n, int64_t cols,
                                        const float* add_a, int64_t masked) {
  switch ((cols + 15) / 16) {
    case 1:
      return SoftmaxShortRowsOf<1, kBf16Only, kNative>(rows, n, cols, add_a, masked);
    case 2:
      return SoftmaxShortRowsOf<2, kBf16Only, kNative>(rows, n, cols, add_a, masked);
    case 3:
      return SoftmaxShortRowsOf<3, kBf16Only, kNative>(rows, n, cols, add_a, masked);
    default:
      return SoftmaxShortRowsOf<4, kBf16Only, kNative>(rows, n, cols, add_a, masked);
  }
}

}  // namespace

void SoftmaxShortRowsAvx512(const ShortSoftmaxRow* rows, int n, int64_t cols, const float* add_a,
                            int64_t masked, bool bf16_only) {
  const bool native = ActiveKernelIsa() == KernelIsa::kAvx512Bf16;
  if (bf16_only) {
    return native ? SoftmaxShortRowsIn<true, true>(rows, n, cols, add_a, masked)
                  : SoftmaxShortRowsIn<true, false>(rows, n, cols, add_a, masked);
  }
  native ? SoftmaxShortRowsIn<false, true>(rows, n, cols, add_a, masked)
         : SoftmaxShortRowsIn<false, false>(rows, n, cols, add_a, masked);
}

void DequantizeRowAvx512(const int32_t* sums, int64_t n, float row_scale, const float* col_scales,
                         const int32_t* offset_share, const float* bias, bool bf16, void* out) {
  if (!bf16) {
    return DequantizeRowOf<false, false>(sums, n, row_scale, col_scales, offset_share, bias, out);
  }
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return DequantizeRowOf<true, true>(sums, n, row_scale, col_scales, offset_share, bias, out);
  }
  DequantizeRowOf<true, false>(sums, n, row_scale, col_scales, offset_share, bias, out);
}

KernelIsa ActiveKernelIsa() {
  static const KernelIsa detected = DetectIsa();
  return std::min(detected, isa_cap.load(std::memory_order_relaxed));
}

const char* KernelIsaName(KernelIsa isa) {
  constexpr const char* kNames[] = {"portable", "avx2", "avx512", "avx512_bf16"};
  return kNames[static_cast<int>(isa)];
}

void CapKernelIsaForTesting(KernelIsa cap) { isa_cap.store(cap); }

bool HasAvx512() { return ActiveKernelIsa() >= KernelIsa::kAvx512; }

float ExpSumAvx512(float* row, int64_t cols, float max) {
  return ExpSumOf<ExpOut::kF32>(row, cols, max, row, nullptr);
}

float ExpSumAccurateAvx512(float* row, int64_t cols, float max) {
  return ExpSumOf<ExpOut::kF32Accurate>(row, cols, max, row, nullptr);
}

float ExpSumToBf16Avx512(const float* row, int64_t cols, float max, uint16_t* out) {
  return ActiveKernelIsa() == KernelIsa::kAvx512Bf16
             ? ExpSumOf<ExpOut::kBf16Native>(row, cols, max, nullptr, out)
             : ExpSumOf<ExpOut::kBf16Integer>(row, cols, max, nullptr, out);
}

void ScaleToBf16Avx512(const float* in, float scale, uint16_t* out, int64_t count) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return ScaleToBf16Of<true>(in, scale, out, count);
  }
  ScaleToBf16Of<false>(in, scale, out, count);
}

}  // namespace mha
