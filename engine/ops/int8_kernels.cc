// The step loops of int8 session caches (kv_cache_dtype INT8): scores
// against int8 keys and context over int8 values, at the kernel level
// ActiveKernelIsa() allows: AVX-512, AVX2 (both widen 16 or 8 int8 values
// per instruction; GCC 12 turns a vector conversion from int8 into scalar
// code) or portable loops. Tests cap the level to run each path on one CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/dtype.h"
#include "engine/kv_cache.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/intrinsics.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"

namespace mha {
namespace {

constexpr int64_t kTokens = KvLayout::kBlockTokens;
static_assert(kTokens == 32, "the loops below read blocks of 32 tokens");

inline float QueryAt(const float* q_f32, const uint16_t* q_bf16, int64_t c) {
  if (q_f32 != nullptr) return q_f32[c];
  return Bf16ToFloat(q_bf16[c]);
}

// out[j] = scale * key_scales[j] * sums[j] for j < n.
inline void ScaleScores(const float* sums, const float* key_scales, float* out, int64_t n,
                        float scale) {
  for (int64_t j = 0; j < n; ++j) out[j] = sums[j] * scale * key_scales[j];
}

// ---- portable --------------------------------------------------------------

void ScoresPortable(const float* q_f32, const uint16_t* q_bf16, const int8_t* kt,
                    const float* key_scales, float* out, int64_t n, int64_t d, float scale,
                    const void* next) {
  float sums[kTokens] = {};
  for (int64_t c = 0; c < d; ++c) {
    const float q = QueryAt(q_f32, q_bf16, c);
    const int8_t* row = kt + c * kTokens;
    if (c % 2 == 0) FetchNext<64>(next, c * kTokens);  // two rows a line
    for (int64_t j = 0; j < kTokens; ++j) sums[j] += q * static_cast<float>(row[j]);
  }
  ScaleScores(sums, key_scales, out, n, scale);
}

void ContextPortable(const float* probs, const int8_t* v, float* acc, int64_t cols, int64_t dv,
                     const void* next) {
  for (int64_t j = 0; j < cols; ++j) {
    const float p = probs[j];
    const int8_t* row = v + j * dv;
    for (int64_t c = 0; c < dv; c += 64) FetchNext<64>(next, j * dv + c);
    for (int64_t c = 0; c < dv; ++c) acc[c] += p * static_cast<float>(row[c]);
  }
}

// ---- AVX2 ------------------------------------------------------------------

#define MHA_AVX2 __attribute__((target("avx2,fma")))

// 8 int8 values at `p` as 8 floats.
MHA_AVX2 inline __m256 Widen8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

MHA_AVX2 void ScoresAvx2(const float* q_f32, const uint16_t* q_bf16, const int8_t* kt,
                         const float* key_scales, float* out, int64_t n, int64_t d, float scale,
                         const void* next) {
  // Two rows at a time into two sets of four sums (32 tokens each).
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  __m256 b[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  int64_t c = 0;
  for (; c + 2 <= d; c += 2) {
    const __m256 qa = _mm256_set1_ps(QueryAt(q_f32, q_bf16, c));
    const __m256 qb = _mm256_set1_ps(QueryAt(q_f32, q_bf16, c + 1));
    const int8_t* ra = kt + c * kTokens;
    const int8_t* rb = ra + kTokens;
    FetchNext<64>(next, c * kTokens);  // both rows
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_fmadd_ps(qa, Widen8(ra + 8 * i), a[i]);
      b[i] = _mm256_fmadd_ps(qb, Widen8(rb + 8 * i), b[i]);
    }
  }
  if (c < d) {
    const __m256 qa = _mm256_set1_ps(QueryAt(q_f32, q_bf16, c));
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_fmadd_ps(qa, Widen8(kt + c * kTokens + 8 * i), a[i]);
    }
  }
  float sums[kTokens];
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(sums + 8 * i, _mm256_add_ps(a[i], b[i]));
  ScaleScores(sums, key_scales, out, n, scale);
}

MHA_AVX2 void ContextAvx2(const float* probs, const int8_t* v, float* acc, int64_t cols, int64_t dv,
                          const void* next) {
  int64_t c0 = 0;
  for (; c0 + 8 <= dv; c0 += 8) {  // 8 columns, two rows at a time
    __m256 a = _mm256_loadu_ps(acc + c0), b = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      if (c0 % 64 == 0) {  // each line of the two rows once
        FetchNext<64>(next, j * dv + c0);
        FetchNext<64>(next, (j + 1) * dv + c0);
      }
      a = _mm256_fmadd_ps(_mm256_set1_ps(probs[j]), Widen8(v + j * dv + c0), a);
      b = _mm256_fmadd_ps(_mm256_set1_ps(probs[j + 1]), Widen8(v + (j + 1) * dv + c0), b);
    }
    if (j < cols) a = _mm256_fmadd_ps(_mm256_set1_ps(probs[j]), Widen8(v + j * dv + c0), a);
    _mm256_storeu_ps(acc + c0, _mm256_add_ps(a, b));
  }
  for (int64_t j = 0; j < cols && c0 < dv; ++j) {
    for (int64_t c = c0; c < dv; ++c) acc[c] += probs[j] * static_cast<float>(v[j * dv + c]);
  }
}

// ---- AVX-512 ---------------------------------------------------------------

#define MHA_AVX512 __attribute__((target("avx512f")))

// 16 int8 values at `p` as 16 floats.
MHA_AVX512 inline __m512 Widen16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

MHA_AVX512 void ScoresAvx512(const float* q_f32, const uint16_t* q_bf16, const int8_t* kt,
                             const float* key_scales, float* out, int64_t n, int64_t d, float scale,
                             const void* next) {
  // Four rows at a time into four pairs of sums (independent chains).
  __m512 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    FetchNext<4 * kTokens>(next, c * kTokens);
    for (int i = 0; i < 4; ++i) {
      const __m512 q = _mm512_set1_ps(QueryAt(q_f32, q_bf16, c + i));
      const int8_t* row = kt + (c + i) * kTokens;
      lo[i] = _mm512_fmadd_ps(q, Widen16(row), lo[i]);
      hi[i] = _mm512_fmadd_ps(q, Widen16(row + 16), hi[i]);
    }
  }
  for (; c < d; ++c) {
    const __m512 q = _mm512_set1_ps(QueryAt(q_f32, q_bf16, c));
    lo[0] = _mm512_fmadd_ps(q, Widen16(kt + c * kTokens), lo[0]);
    hi[0] = _mm512_fmadd_ps(q, Widen16(kt + c * kTokens + 16), hi[0]);
  }
  float sums[kTokens];
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_add_ps(lo[0], lo[1]), _mm512_add_ps(lo[2], lo[3])));
  _mm512_storeu_ps(sums + 16,
                   _mm512_add_ps(_mm512_add_ps(hi[0], hi[1]), _mm512_add_ps(hi[2], hi[3])));
  ScaleScores(sums, key_scales, out, n, scale);
}

MHA_AVX512 void ContextAvx512(const float* probs, const int8_t* v, float* acc, int64_t cols,
                              int64_t dv, const void* next) {
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) {  // 64 columns in registers, two rows at a time
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm512_loadu_ps(acc + c0 + 16 * i);
      b[i] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      const __m512 pa = _mm512_set1_ps(probs[j]), pb = _mm512_set1_ps(probs[j + 1]);
      const int8_t* x = v + j * dv + c0;
      FetchNext<64>(next, j * dv + c0);
      FetchNext<64>(next, (j + 1) * dv + c0);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(pa, Widen16(x + 16 * i), a[i]);
        b[i] = _mm512_fmadd_ps(pb, Widen16(x + dv + 16 * i), b[i]);
      }
    }
    if (j < cols) {
      const __m512 pa = _mm512_set1_ps(probs[j]);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(pa, Widen16(v + j * dv + c0 + 16 * i), a[i]);
      }
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + c0 + 16 * i, _mm512_add_ps(a[i], b[i]));
  }
  for (; c0 + 16 <= dv; c0 += 16) {  // 16 at a time
    __m512 a = _mm512_loadu_ps(acc + c0);
    for (int64_t j = 0; j < cols; ++j) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(probs[j]), Widen16(v + j * dv + c0), a);
    }
    _mm512_storeu_ps(acc + c0, a);
  }
  for (int64_t j = 0; j < cols && c0 < dv; ++j) {
    for (int64_t c = c0; c < dv; ++c) acc[c] += probs[j] * static_cast<float>(v[j * dv + c]);
  }
}

void Scores(const float* q_f32, const uint16_t* q_bf16, const int8_t* kt, const float* key_scales,
            float* out, int64_t n, int64_t d, float scale, const void* next) {
  if (next == nullptr) next = kt;
  const KernelIsa isa = ActiveKernelIsa();
  if (isa >= KernelIsa::kAvx512) {
    return ScoresAvx512(q_f32, q_bf16, kt, key_scales, out, n, d, scale, next);
  }
  if (isa == KernelIsa::kAvx2) {
    return ScoresAvx2(q_f32, q_bf16, kt, key_scales, out, n, d, scale, next);
  }
  ScoresPortable(q_f32, q_bf16, kt, key_scales, out, n, d, scale, next);
}

}  // namespace

void BlockScoresF32Int8(const float* q, const int8_t* kt, const float* key_scales, float* out,
                        int64_t n, int64_t d, float scale, const void* next) {
  Scores(q, nullptr, kt, key_scales, out, n, d, scale, next);
}

void BlockScoresBf16Int8(const uint16_t* q, const int8_t* kt, const float* key_scales, float* out,
                         int64_t n, int64_t d, float scale, const void* next) {
  Scores(nullptr, q, kt, key_scales, out, n, d, scale, next);
}

void AccumulateContextInt8(const float* probs, const int8_t* v, float* acc, int64_t cols,
                           int64_t dv, const void* next) {
  if (next == nullptr) next = v;
  const KernelIsa isa = ActiveKernelIsa();
  if (isa >= KernelIsa::kAvx512) return ContextAvx512(probs, v, acc, cols, dv, next);
  if (isa == KernelIsa::kAvx2) return ContextAvx2(probs, v, acc, cols, dv, next);
  ContextPortable(probs, v, acc, cols, dv, next);
}

MHA_MULTIVERSION
float QuantizeInt8(const float* in, int64_t n, int8_t* out, int64_t stride) {
  float largest = 0.0f;
  bool finite = true;
  for (int64_t c = 0; c < n; ++c) {
    largest = std::max(largest, std::fabs(in[c]));
    finite &= std::isfinite(in[c]);
  }
  if (!finite) {
    for (int64_t c = 0; c < n; ++c) out[c * stride] = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (largest == 0.0f) {
    for (int64_t c = 0; c < n; ++c) out[c * stride] = 0;
    return 0.0f;
  }
  // x / largest first: 127 / largest overflows for rows below ~4e-37.
  for (int64_t c = 0; c < n; ++c) {
    const float q = std::nearbyint(in[c] / largest * 127.0f);
    out[c * stride] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
  }
  return largest / 127.0f;
}

}  // namespace mha
