// The bf16 cache's step loops with AVX512-BF16's pair dot product
// (vdpbf16ps: acc += a0 b0 + a1 b1 per f32 lane, products exact, sums
// rounded to nearest even, denormals as 0). Scores: two key rows (elements
// c and c + 1 of 32 tokens) are interleaved into token pairs and meet the
// query's pair (q[c], q[c + 1]) in one instruction, where the widening loop
// takes two shifts, two masks and four multiply-adds. Context: two value
// rows (tokens j and j + 1) into column pairs, against the probabilities'
// pair rounded to bf16. The small path's scores and context (a short
// sequence's heads whole) the same way, 8 rows at a time so that each key
// or value pair loaded serves 8 rows and 16 sums are in flight (one row at a
// time waited on its own chain: EPYC VM, 4 heads x 16 x 16 x 64, scores
// 0.92 -> 0.60 us, context 1.70 -> 0.51 us); its keys transposed 16 at a time.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/kv_cache.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/intrinsics.h"
#include "engine/ops/multiversion.h"
#include "engine/ops/transpose_avx512.h"

namespace mha {
namespace {

#define MHA_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MHA_BF16_DOT_INLINE MHA_BF16_DOT __attribute__((always_inline)) inline

constexpr int64_t kTokens = KvLayout::kBlockTokens;
static_assert(kTokens == 32, "one block row of bf16 is one 64-byte vector");

// acc += pairs . (q0, q1), pairs interleaving rows r0 and r1 (unpack works
// within 128-bit lanes: `lo` gets tokens 8L + 0..3 of lane L, `hi` 8L + 4..7).
MHA_BF16_DOT inline void AddRowPair(__m512i r0, __m512i r1, __m512i q_pair, __m512& lo,
                                    __m512& hi) {
  lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(r0, r1), (__m512bh)q_pair);
  hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(r0, r1), (__m512bh)q_pair);
}

// Row c of a block's keys: element c of its 32 tokens.
MHA_BF16_DOT inline __m512i Row(const uint16_t* kt, int64_t c) {
  return _mm512_loadu_si512(kt + c * kTokens);
}

// (q[c], q[c + 1]) in every lane, q[c] in the low half.
MHA_BF16_DOT inline __m512i QueryPair(const uint16_t* q, int64_t c) {
  uint32_t bits;
  std::memcpy(&bits, q + c, sizeof bits);
  return _mm512_set1_epi32(static_cast<int>(bits));
}

MHA_BF16_DOT inline __mmask16 FirstLanes(int64_t count) {
  return count >= 16 ? __mmask16{0xffff}
                     : static_cast<__mmask16>((1u << (count > 0 ? count : 0)) - 1);
}

// Sums of 32 tokens (or columns) in their order, from AddRowPair's `lo`
// and `hi` (token 8L + i, i < 4, is lo[4L + i]; 8L + 4 + i is hi[4L + i]):
// tokens 0..15, or 16..31 with `second`.
MHA_BF16_DOT inline __m512 InOrder(__m512 lo, __m512 hi, bool second) {
  const __m512i first_idx =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_idx =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_permutex2var_ps(lo, second ? second_idx : first_idx, hi);
}

// The first `count` of a vector's 32 bf16 lanes.
MHA_BF16_DOT inline __mmask32 FirstBf16Lanes(int64_t count) {
  return count >= 32 ? ~__mmask32{0}
                     : static_cast<__mmask32>((uint32_t{1} << (count > 0 ? count : 0)) - 1);
}

// A small head's first `keys` (<= 16) keys from `k` [.., d] as pairs:
// pairs[p] holds (k[j][2p], k[j][2p + 1]) of key j in lane j, zeros past
// the keys. 16 pairs of 16 keys at a time, transposed in registers.
MHA_BF16_DOT inline void KeyPairs(const uint16_t* k, int64_t d, int64_t keys, __m512i* pairs) {
  const int64_t n = d / 2;
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    __m512i a[16];
    LoadPairsTransposed(k, d, keys, n, p0, a);
    for (int64_t m = 0; m < std::min<int64_t>(16, n - p0); ++m) pairs[p0 + m] = a[m];
  }
}

// R rows of a small head's scores against one chunk of up to 16
// keys (`pairs`, KeyPairs'): two chains of sums a row (even and odd pairs),
// so that R = 8 rows keep 16 independent sums in flight and each key pair
// loaded serves R rows.
template <int R>
MHA_BF16_DOT_INLINE void ScoreRows(const uint16_t* q, int64_t d, const __m512i* pairs,
                                   __m512 factor, __mmask16 lanes, float* out, int64_t out_stride) {
  __m512 even[R], odd[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int64_t n = d / 2;
  int64_t p = 0;
  for (; p + 2 <= n; p += 2) {
    const __m512bh k0 = (__m512bh)pairs[p], k1 = (__m512bh)pairs[p + 1];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)QueryPair(q + r * d, 2 * p), k0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)QueryPair(q + r * d, 2 * p + 2), k1);
    }
  }
  if (p < n) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] =
          _mm512_dpbf16_ps(even[r], (__m512bh)QueryPair(q + r * d, 2 * p), (__m512bh)pairs[p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * out_stride, lanes,
                          _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), factor));
  }
}

// A row's probabilities from key `j0` on (`n` <= kSmallContextKeys of
// them) as bf16 pairs: pairs[u] = (p[2u], p[2u + 1]), zeros past `n`.
constexpr int64_t kSmallContextKeys = 512;
MHA_BF16_DOT_INLINE void ProbPairs(const float* p, int64_t n, uint32_t* pairs) {
  for (int64_t j = 0; j < n; j += 32) {  // plain loads where whole (masked ones cost more)
    const __m512 lo =
        j + 16 <= n ? _mm512_loadu_ps(p + j) : _mm512_maskz_loadu_ps(FirstLanes(n - j), p + j);
    const __m512 hi = j + 32 <= n ? _mm512_loadu_ps(p + j + 16)
                                  : _mm512_maskz_loadu_ps(FirstLanes(n - j - 16), p + j + 16);
    _mm512_storeu_si512(pairs + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// R rows' probabilities (`cols` apart) from key `j0` on as pairs, a row
// kSmallContextKeys / 2 apart.
template <int R>
MHA_BF16_DOT_INLINE void RowsProbPairs(const float* probs, int64_t cols, int64_t j0,
                                       uint32_t* pairs) {
  const int64_t n = std::min(kSmallContextKeys, cols - j0);
  for (int r = 0; r < R; ++r)
    ProbPairs(probs + r * cols + j0, n, pairs + r * (kSmallContextKeys / 2));
}

// Adds to R rows' sums of 32 columns (`lo`, `hi` as AddRowPair leaves
// them) their `n` keys' values weighted: each pair of value rows is
// interleaved once and meets the R rows' probability pairs (`pairs`, a row
// kSmallContextKeys / 2 apart). `columns`: the chunk's columns when fewer
// than 32 (masked loads), else plain ones.
template <int R, bool kWhole>
MHA_BF16_DOT_INLINE void ContextColumns(const uint32_t* pairs, const uint16_t* v, int64_t dv,
                                        int64_t n, __mmask32 columns, __m512 (&lo)[R],
                                        __m512 (&hi)[R]) {
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* row = v + j * dv;
    const __m512i r0 = kWhole ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi16(columns, row);
    const __m512i r1 = j + 1 >= n ? _mm512_setzero_si512()
                       : kWhole   ? _mm512_loadu_si512(row + dv)
                                  : _mm512_maskz_loadu_epi16(columns, row + dv);
    const __m512bh even = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
    const __m512bh odd = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh p =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * (kSmallContextKeys / 2) + j / 2]));
      lo[r] = _mm512_dpbf16_ps(lo[r], even, p);
      hi[r] = _mm512_dpbf16_ps(hi[r], odd, p);
    }
  }
}

// R rows of a small head's context: per chunk of 32 columns, R
// rows' sums in registers over every key, then rounded to bf16.
template <int R>
MHA_BF16_DOT_INLINE void ContextRows(const float* probs, const uint16_t* v, uint16_t* context,
                                     int64_t cols, int64_t dv) {
  alignas(64) uint32_t pairs[R * (kSmallContextKeys / 2)];
  const bool one_chunk = cols <= kSmallContextKeys;  // converted once for every column chunk
  if (one_chunk) RowsProbPairs<R>(probs, cols, 0, pairs);
  for (int64_t c0 = 0; c0 < dv; c0 += 32) {
    const __mmask32 columns = FirstBf16Lanes(dv - c0);
    __m512 lo[R], hi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < cols; j0 += kSmallContextKeys) {
      if (!one_chunk) RowsProbPairs<R>(probs, cols, j0, pairs);
      const int64_t n = std::min(kSmallContextKeys, cols - j0);
      if (dv - c0 >= 32) {
        ContextColumns<R, true>(pairs, v + j0 * dv + c0, dv, n, columns, lo, hi);
      } else {
        ContextColumns<R, false>(pairs, v + j0 * dv + c0, dv, n, columns, lo, hi);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i out =
          (__m512i)_mm512_cvtne2ps_pbh(InOrder(lo[r], hi[r], true), InOrder(lo[r], hi[r], false));
      _mm512_mask_storeu_epi16(context + r * dv + c0, columns, out);
    }
  }
}

}  // namespace

MHA_BF16_DOT void SmallScoresBf16Dot(const uint16_t* q, const uint16_t* k, float* scores,
                                     int64_t batch, int64_t rows, int64_t cols, int64_t d,
                                     float scale) {
  __m512i pairs[kSmallDotMaxDepth / 2];
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < batch; ++b) {
    const uint16_t* qb = q + b * rows * d;
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      const __mmask16 lanes = FirstLanes(cols - j0);
      KeyPairs(k + (b * cols + j0) * d, d, std::min<int64_t>(16, cols - j0), pairs);
      float* out = scores + b * rows * cols + j0;
      int64_t i = 0;
      for (; i + 8 <= rows; i += 8)
        ScoreRows<8>(qb + i * d, d, pairs, factor, lanes, out + i * cols, cols);
      if (rows - i >= 4)
        ScoreRows<4>(qb + i * d, d, pairs, factor, lanes, out + i * cols, cols), i += 4;
      if (rows - i >= 2)
        ScoreRows<2>(qb + i * d, d, pairs, factor, lanes, out + i * cols, cols), i += 2;
      if (rows - i >= 1) ScoreRows<1>(qb + i * d, d, pairs, factor, lanes, out + i * cols, cols);
    }
  }
}

MHA_BF16_DOT void SmallContextBf16Dot(const float* probs, const uint16_t* v, uint16_t* context,
                                      int64_t batch, int64_t rows, int64_t cols, int64_t dv) {
  for (int64_t b = 0; b < batch; ++b) {
    const uint16_t* vb = v + b * cols * dv;
    const float* pb = probs + b * rows * cols;
    uint16_t* out = context + b * rows * dv;
    int64_t i = 0;
    for (; i + 8 <= rows; i += 8) ContextRows<8>(pb + i * cols, vb, out + i * dv, cols, dv);
    if (rows - i >= 4) ContextRows<4>(pb + i * cols, vb, out + i * dv, cols, dv), i += 4;
    if (rows - i >= 2) ContextRows<2>(pb + i * cols, vb, out + i * dv, cols, dv), i += 2;
    if (rows - i >= 1) ContextRows<1>(pb + i * cols, vb, out + i * dv, cols, dv);
  }
}

MHA_BF16_DOT void BlockScoresBf16Dot(const uint16_t* q, const uint16_t* kt, float* out, int64_t n,
                                     int64_t d, float scale, const void* next) {
  if (next == nullptr) next = kt;
  // Two chains of sums, rows c, c + 1 into the first and c + 2, c + 3 into
  // the second, so their latency overlaps.
  __m512 lo0 = _mm512_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    FetchNext<4 * kTokens * 2>(next, c * kTokens * 2);
    AddRowPair(Row(kt, c), Row(kt, c + 1), QueryPair(q, c), lo0, hi0);
    AddRowPair(Row(kt, c + 2), Row(kt, c + 3), QueryPair(q, c + 2), lo1, hi1);
  }
  for (; c + 2 <= d; c += 2) AddRowPair(Row(kt, c), Row(kt, c + 1), QueryPair(q, c), lo0, hi0);
  if (c < d) {  // an odd last row, paired with zeros
    AddRowPair(Row(kt, c), _mm512_setzero_si512(), _mm512_set1_epi32(q[c]), lo0, hi0);
  }
  const __m512 lo = _mm512_add_ps(lo0, lo1), hi = _mm512_add_ps(hi0, hi1);
  const __m512 factor = _mm512_set1_ps(scale);
  _mm512_mask_storeu_ps(out, FirstLanes(n), _mm512_mul_ps(InOrder(lo, hi, false), factor));
  _mm512_mask_storeu_ps(out + 16, FirstLanes(n - 16), _mm512_mul_ps(InOrder(lo, hi, true), factor));
}

MHA_BF16_DOT void AccumulateContextBf16Dot(const float* probs, const uint16_t* v, float* acc,
                                           int64_t cols, int64_t dv, const void* next) {
  if (next == nullptr) next = v;
  // The block's probabilities as bf16 pairs: pairs[k] = (p[2k], p[2k + 1]),
  // zero past `cols`.
  uint32_t pairs[kTokens / 2];
  const __m512 p_lo = _mm512_maskz_loadu_ps(FirstLanes(cols), probs);
  const __m512 p_hi = _mm512_maskz_loadu_ps(FirstLanes(cols - 16), probs + 16);
  _mm512_storeu_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(p_hi, p_lo));
  // Sums of columns c0 + 8L + 0..3 (lo) and + 4..7 (hi), as AddRowPair
  // leaves them, into acc's split order (kernels.h: even columns, then odd
  // ones, per 32).
  const __m512i even = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) {
    __m512 lo0 = _mm512_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    auto row = [v, dv, c0](int64_t j, int64_t half) { return v + j * dv + c0 + 32 * half; };
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      FetchNext<128>(next, (j * dv + c0) * 2);
      FetchNext<128>(next, ((j + 1) * dv + c0) * 2);
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pairs[j / 2]));
      AddRowPair(_mm512_loadu_si512(row(j, 0)), _mm512_loadu_si512(row(j + 1, 0)), p, lo0, hi0);
      AddRowPair(_mm512_loadu_si512(row(j, 1)), _mm512_loadu_si512(row(j + 1, 1)), p, lo1, hi1);
    }
    if (j < cols) {  // an odd last row, paired with zeros (the next slot may hold anything)
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pairs[j / 2]));
      AddRowPair(_mm512_loadu_si512(row(j, 0)), _mm512_setzero_si512(), p, lo0, hi0);
      AddRowPair(_mm512_loadu_si512(row(j, 1)), _mm512_setzero_si512(), p, lo1, hi1);
    }
    float* split = acc + c0;
    const __m512 sums[4] = {
        _mm512_permutex2var_ps(lo0, even, hi0), _mm512_permutex2var_ps(lo0, odd, hi0),
        _mm512_permutex2var_ps(lo1, even, hi1), _mm512_permutex2var_ps(lo1, odd, hi1)};
    for (int i = 0; i < 4; ++i) {
      _mm512_storeu_ps(split + 16 * i, _mm512_add_ps(_mm512_loadu_ps(split + 16 * i), sums[i]));
    }
  }
  for (int64_t j = 0; j < cols && c0 < dv; ++j) {  // the rest, in order, as the widening loop
    const uint16_t* vj = v + j * dv;
    for (int64_t c = c0; c < dv; ++c) {
      const uint32_t bits = static_cast<uint32_t>(vj[c]) << 16;
      float x;
      std::memcpy(&x, &bits, sizeof x);
      acc[c] += probs[j] * x;
    }
  }
}

}  // namespace mha
