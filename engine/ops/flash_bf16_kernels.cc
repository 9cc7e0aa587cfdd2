// Key-tiled attention of one block of query rows of one head in one pass,
// with AVX512-BF16's pair dot product (flash-attention style, no score
// ever stored): each tile of 64 keys is packed into pairs once, then every
// group of 4 query rows gets its 4 x 64 scores in registers, its online
// softmax there, and the tile's weighted sum of values added to its
// accumulator. oneDNN's per-tile products wrote each tile's f32 scores
// through the core's L2 and back, and ran at ~81 % of the bf16 matmul rate
// in situ where the same products alone run at 93-97 %.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/ops/exp_avx512.h"
#include "engine/ops/flash_bf16.h"
#include "engine/ops/intrinsics.h"
#include "engine/ops/kernels.h"
#include "engine/ops/transpose_avx512.h"

namespace mha {
namespace {

#define MHA_FLASH_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define MHA_FLASH_BF16_INLINE MHA_FLASH_BF16 __attribute__((always_inline)) inline

constexpr int64_t kTile = kFlashBf16TileKeys;  // keys per tile: 4 vectors of scores
constexpr int64_t kTilePairs = kTile / 2;      // key pairs per tile
constexpr int kGroup = 4;                      // query rows a pass keeps in registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys [cols, dqk] (rows `stride` apart) as pairs: out[p * 64 + j] =
// (k[j][2p], k[j][2p + 1]), the low half first; zeros past `cols`. Blocks
// of 16 keys by 16 pairs are transposed in registers (a gather per output
// vector ran ~3x slower, a store per key 4x slower).
MHA_FLASH_BF16 void PackKeyTile(const uint16_t* k, int64_t stride, int64_t dqk, int64_t cols,
                                uint32_t* out) {
  const int64_t pairs = dqk / 2;
  for (int64_t j0 = 0; j0 < kTile; j0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i a[16];
      LoadPairsTransposed(k + j0 * stride, stride, cols - j0, pairs, p0, a);
      const int64_t n = std::min<int64_t>(16, pairs - p0);
      for (int64_t m = 0; m < n; ++m) _mm512_storeu_si512(out + (p0 + m) * kTile + j0, a[m]);
    }
  }
}

// Values [cols, dv] (rows `stride` apart) as pairs of keys: out[u * dv + c]
// = (v[2u][c], v[2u + 1][c]), the low half first; zeros past `cols`.
MHA_FLASH_BF16 void PackValueTile(const uint16_t* v, int64_t stride, int64_t dv, int64_t cols,
                                  uint32_t* out) {
  for (int64_t u = 0; u < kTilePairs; ++u) {
    const int64_t k0 = 2 * u, k1 = 2 * u + 1;
    uint32_t* o = out + u * dv;
    if (k0 >= cols) {
      std::memset(o, 0, sizeof(uint32_t) * dv);
      continue;
    }
    const uint16_t* r0 = v + k0 * stride;
    const uint16_t* r1 = k1 < cols ? v + k1 * stride : nullptr;
    for (int64_t c = 0; c < dv; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + c)));
      const __m512i hi = r1 == nullptr
                             ? _mm512_setzero_si512()
                             : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + c)));
      _mm512_storeu_si512(o + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// What a tile is: its packed keys and values, where it starts, and how many
// of its 64 keys exist.
struct Tile {
  const uint32_t* key_pairs = nullptr;
  const uint32_t* value_pairs = nullptr;
  int64_t col0 = 0, cols = 0;
};

// s[r][j] = q[r] . keys 16j..16j+15 of the tile, in f32.
template <int R>
MHA_FLASH_BF16_INLINE void GroupScores(const uint16_t* q, int64_t dqk, const uint32_t* key_pairs,
                                       __m512 (&s)[R][4]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < dqk / 2; ++p) {
    const uint32_t* kp = key_pairs + p * kTile;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + 16);
    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kp + 32);
    const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kp + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      uint32_t bits;
      std::memcpy(&bits, q + r * dqk + 2 * p, sizeof bits);
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qp, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qp, k1);
      s[r][2] = _mm512_dpbf16_ps(s[r][2], qp, k2);
      s[r][3] = _mm512_dpbf16_ps(s[r][3], qp, k3);
    }
  }
}

// Scales one row's tile scores and applies its masks, as OnlineSoftmaxTile
// does: the additive masks on the first `masked` keys, -inf from
// `causal_limit` to `masked`, and -inf past the tile's keys.
MHA_FLASH_BF16_INLINE void MaskRow(__m512 (&s)[4], float scale, const float* pad, const float* attn,
                                   int64_t masked, int64_t causal_limit, int64_t cols) {
  // Base 2 from here on: 2^(x log2 e) = e^x.
  const __m512 log2e = _mm512_set1_ps(exp_polynomial::kLog2e);
  const __m512 factor = _mm512_set1_ps(scale * exp_polynomial::kLog2e);
  const bool plain = pad == nullptr && attn == nullptr && causal_limit >= masked && cols == kTile;
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m512 x = _mm512_mul_ps(s[j], factor);
    if (!plain) {
      const int64_t base = 16 * j;
      const __mmask16 in_masked = TailLanes(masked - base);
      if (pad != nullptr)
        x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in_masked, pad + base), log2e, x);
      if (attn != nullptr) {
        x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in_masked, attn + base), log2e, x);
      }
      const __mmask16 dead = static_cast<__mmask16>(~TailLanes(cols - base)) |
                             (in_masked & static_cast<__mmask16>(~TailLanes(causal_limit - base)));
      x = _mm512_mask_mov_ps(x, dead, _mm512_set1_ps(kNegInf));
    }
    s[j] = x;
  }
}

// One row's online softmax over its tile (OnlineSoftmaxTile's rules): the
// probabilities exp(s - new max) as bf16 pairs in `probs`, the running
// max and sum updated; returns the factor for the row's accumulator.
MHA_FLASH_BF16_INLINE float SoftmaxRow(__m512 (&s)[4], float& max, float& sum, uint32_t* probs) {
  const float tile_max =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
  const float new_max = tile_max > max ? tile_max : max;
  if (!(tile_max < std::numeric_limits<float>::infinity()) || new_max == kNegInf) {
    // Overflowed scores poison the row (NaN sum); keys all masked so far
    // add nothing. Either way this tile contributes zeros.
    if (tile_max != kNegInf) sum = std::numeric_limits<float>::quiet_NaN();
    _mm512_storeu_si512(probs, _mm512_setzero_si512());
    _mm512_storeu_si512(probs + 16, _mm512_setzero_si512());
    return 1.0f;
  }
  // 0 on the first contributing tile (max -inf).
  const float rescale = _mm512_cvtss_f32(Exp2NonPositive(_mm512_set1_ps(max - new_max)));
  const __m512 m = _mm512_set1_ps(new_max);
  __m512 e[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) e[j] = Exp2NonPositive(_mm512_sub_ps(s[j], m));
  const float tile_sum =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
  // Lanes of the second operand go low: keys 0..31, then 32..63.
  _mm512_storeu_si512(probs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  _mm512_storeu_si512(probs + 16, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
  sum = sum * rescale + tile_sum;
  max = new_max;
  return rescale;
}

template <bool kMax>
MHA_FLASH_BF16_INLINE __m512 MaxOrAdd(__m512 x, __m512 y) {
  return kMax ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y);
}

// Four rows' 16-lane vectors reduced (max, or sum) at once: block b (lanes
// 4b .. 4b + 3) of the result holds row b's reduction in every lane.
template <bool kMax>
MHA_FLASH_BF16_INLINE __m512 ReduceFourRows(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab =
      MaxOrAdd<kMax>(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const __m512 cd =
      MaxOrAdd<kMax>(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 x = MaxOrAdd<kMax>(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  x = MaxOrAdd<kMax>(x, _mm512_permute_ps(x, 0x4e));
  return MaxOrAdd<kMax>(x, _mm512_permute_ps(x, 0xb1));
}

// Row r's value of a ReduceFourRows result in every lane.
template <int r>
MHA_FLASH_BF16_INLINE __m512 RowOf(__m512 blocks) {
  return _mm512_shuffle_f32x4(blocks, blocks, r * 0x55);
}

// The first R rows' values of a ReduceFourRows result, one float each.
template <int R>
MHA_FLASH_BF16_INLINE void StoreRows(__m512 blocks, float* out) {
  const __m512 firsts = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), blocks);
  _mm_mask_storeu_ps(out, static_cast<__mmask8>((1u << R) - 1), _mm512_castps512_ps128(firsts));
}

// Row r's value of a ReduceFourRows-shaped vector in every lane, r < 4.
MHA_FLASH_BF16_INLINE __m512 RowOfAny(__m512 blocks, int r) {
  return r == 0   ? RowOf<0>(blocks)
         : r == 1 ? RowOf<1>(blocks)
         : r == 2 ? RowOf<2>(blocks)
                  : RowOf<3>(blocks);
}

// Four floats (rows past R: `fill`) spread as ReduceFourRows leaves its
// result: row r's value in lanes 4r .. 4r + 3.
template <int R>
MHA_FLASH_BF16_INLINE __m512 LoadRows(const float* values, float fill) {
  const __m128 four =
      _mm_mask_loadu_ps(_mm_set1_ps(fill), static_cast<__mmask8>((1u << R) - 1), values);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(four));
}

// The R rows' probabilities exp2(s * factor - max[r]) into `probs` (bf16
// pairs) and their sums, reduced: row r's in lanes 4r .. 4r + 3.
template <int R>
MHA_FLASH_BF16_INLINE __m512 GroupExps(const __m512 (&s)[R][4], __m512 factor, __m512 max,
                                       uint32_t (&probs)[kGroup][kTilePairs]) {
  __m512 row_sum[kGroup];
#pragma GCC unroll 4
  for (int r = 0; r < kGroup; ++r) {
    if (r >= R) {
      row_sum[r] = _mm512_setzero_ps();
      continue;
    }
    const __m512 m = RowOfAny(max, r);
    __m512 e[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) e[j] = Exp2NonPositive(_mm512_fmsub_ps(s[r][j], factor, m));
    row_sum[r] = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
    // Lanes of the second operand go low: keys 0..31, then 32..63.
    _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    _mm512_store_si512(probs[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
  }
  return ReduceFourRows<false>(row_sum[0], row_sum[1], row_sum[2], row_sum[3]);
}

// How far (base 2) a score may rise above its row's running max before the
// max is moved: probabilities up to 2^8 keep every sum far from overflow.
constexpr float kMaxLag = 8.0f;

// The R rows' online softmax over the tile together (SoftmaxRow's rules;
// rows past R are -inf). `score_factor` (> 0; 1 when MaskRow applied it)
// still multiplies the scores; it goes into the exp's FMA. While no score
// rises more than kMaxLag above its row's running max, the max stays and
// nothing is rescaled (no reduction of the maxima, no rescale exp).
// Otherwise one reduction, one rescale exp and one store of the running
// max and sum serve all rows, where row by row each cost a chain of
// shuffles and a scalar round trip. A tile that overflowed, or a row whose
// keys are all masked so far, goes row by row.
template <int R>
MHA_FLASH_BF16_INLINE void SoftmaxGroup(__m512 (&s)[R][4], float score_factor, float* max,
                                        float* sum, uint32_t (&probs)[kGroup][kTilePairs],
                                        float (&rescale)[kGroup]) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 f_in = _mm512_set1_ps(score_factor);
  const __m512 old_max = LoadRows<R>(max, kNegInf);
  __m512 row_max[kGroup];
  __mmask16 moves = 0;
#pragma GCC unroll 4
  for (int r = 0; r < kGroup; ++r) {
    if (r >= R) {
      row_max[r] = neg_inf;
      continue;
    }
    row_max[r] = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    // Unordered (a max still -inf, or NaN) counts as a move.
    moves |= _mm512_cmp_ps_mask(_mm512_fmsub_ps(row_max[r], f_in, RowOfAny(old_max, r)),
                                _mm512_set1_ps(kMaxLag), _CMP_NLE_UQ);
  }
  if (moves == 0) {
    const __m512 tile_sum = GroupExps<R>(s, f_in, old_max, probs);
    StoreRows<R>(_mm512_add_ps(LoadRows<R>(sum, 0.0f), tile_sum), sum);
#pragma GCC unroll 4
    for (int r = 0; r < kGroup; ++r) rescale[r] = 1.0f;
    return;
  }
  const __m512 tile_max =
      _mm512_mul_ps(ReduceFourRows<true>(row_max[0], row_max[1], row_max[2], row_max[3]), f_in);
  // vmaxps gives its second operand when either is NaN: a NaN tile max
  // keeps the old one, as SoftmaxRow's comparison does.
  const __m512 new_max = _mm512_max_ps(tile_max, old_max);
  const __mmask16 used = static_cast<__mmask16>((uint32_t{1} << (4 * R)) - 1);
  const __mmask16 special =
      _mm512_mask_cmp_ps_mask(used, tile_max, _mm512_set1_ps(-kNegInf), _CMP_NLT_UQ) |
      _mm512_mask_cmp_ps_mask(used, new_max, neg_inf, _CMP_EQ_OQ);
  if (special != 0) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) s[r][j] = _mm512_mul_ps(s[r][j], f_in);
      rescale[r] = SoftmaxRow(s[r], max[r], sum[r], probs[r]);
    }
    return;
  }
  const __m512 factor = Exp2NonPositive(_mm512_sub_ps(old_max, new_max));
  const __m512 tile_sum = GroupExps<R>(s, f_in, new_max, probs);
  StoreRows<R>(_mm512_fmadd_ps(LoadRows<R>(sum, 0.0f), factor, tile_sum), sum);
  StoreRows<R>(new_max, max);
  StoreRows<R>(factor, rescale);
}

// acc[r][c0 .. c0 + 16 NV) = acc * rescale[r] + probs[r] . values, over the
// tile's first `pairs` key pairs. Not inlined: inside GroupTile GCC kept
// some of the 16 accumulators on the stack (1.6x slower).
template <int R, int NV>
MHA_FLASH_BF16 __attribute__((noinline)) void GroupContext(
    const uint32_t (&probs)[kGroup][kTilePairs], const uint32_t* value_pairs, int64_t dv,
    int64_t c0, int64_t pairs, const float (&rescale)[kGroup], float* acc) {
  __m512 o[R][NV];
  bool kept = true;  // no max moved (the lazy max's usual case): nothing to rescale
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) kept = kept && rescale[r] == 1.0f;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 f = _mm512_set1_ps(rescale[r]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      o[r][j] = _mm512_loadu_ps(acc + r * dv + c0 + 16 * j);
      if (!kept) o[r][j] = _mm512_mul_ps(o[r][j], f);
    }
  }
  for (int64_t u = 0; u < pairs; ++u) {
    __m512bh vp[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      vp[j] = (__m512bh)_mm512_loadu_si512(value_pairs + u * dv + c0 + 16 * j);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r][u]));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) o[r][j] = _mm512_dpbf16_ps(o[r][j], pp, vp[j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * dv + c0 + 16 * j, o[r][j]);
  }
}

// A group's probabilities of one tile and the factors for its accumulator.
struct GroupProbs {
  alignas(64) uint32_t probs[kGroup][kTilePairs];
  float rescale[kGroup];
};

// Rows [r0, r0 + R) of the block against one tile: scores, masks and
// online softmax.
template <int R>
MHA_FLASH_BF16_INLINE void TileProbs(const FlashBf16Block& b, const Tile& t, int64_t r0,
                                     const FlashBf16Scratch& scratch, GroupProbs& out) {
  __m512 s[R][4];
  GroupScores<R>(b.q + r0 * b.dqk, b.dqk, t.key_pairs, s);
  const SoftmaxMasks& m = b.masks;
  const int64_t masked = std::clamp<int64_t>(m.masked_cols - t.col0, 0, t.cols);
  const float factor = b.scale * exp_polynomial::kLog2e;
  // Rows that see the whole tile unmasked skip MaskRow: its multiply goes
  // into the exp's FMA (one core, 1024 x 1024 x 64: +2 %).
  const bool plain = m.key_padding == nullptr && m.attn == nullptr && t.cols == kTile &&
                     (!m.causal || m.first_row + r0 + 1 - t.col0 >= masked) && factor > 0.0f &&
                     factor < std::numeric_limits<float>::infinity();
  if (plain) {
    SoftmaxGroup<R>(s, factor, scratch.max + r0, scratch.sum + r0, out.probs, out.rescale);
    return;
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const float* pad = m.key_padding == nullptr ? nullptr : m.key_padding + t.col0;
    const float* attn = m.attn == nullptr ? nullptr : m.attn + row * m.attn_row_stride + t.col0;
    const int64_t causal_limit =
        m.causal ? std::clamp<int64_t>(m.first_row + row + 1 - t.col0, 0, masked) : masked;
    MaskRow(s[r], b.scale, pad, attn, masked, causal_limit, t.cols);
  }
  SoftmaxGroup<R>(s, 1.0f, scratch.max + r0, scratch.sum + r0, out.probs, out.rescale);
}

// Adds the tile's values weighted by `p` to rows [r0, r0 + R)'s accumulator.
template <int R>
MHA_FLASH_BF16_INLINE void TileValues(const FlashBf16Block& b, const Tile& t, int64_t r0,
                                      const FlashBf16Scratch& scratch, const GroupProbs& p) {
  const int64_t pairs = (t.cols + 1) / 2;
  float* acc = scratch.acc + r0 * b.dv;
  int64_t c0 = 0;
  for (; c0 + 64 <= b.dv; c0 += 64) {
    GroupContext<R, 4>(p.probs, t.value_pairs, b.dv, c0, pairs, p.rescale, acc);
  }
  switch ((b.dv - c0) / 16) {
    case 3:
      return GroupContext<R, 3>(p.probs, t.value_pairs, b.dv, c0, pairs, p.rescale, acc);
    case 2:
      return GroupContext<R, 2>(p.probs, t.value_pairs, b.dv, c0, pairs, p.rescale, acc);
    case 1:
      return GroupContext<R, 1>(p.probs, t.value_pairs, b.dv, c0, pairs, p.rescale, acc);
    default:
      return;
  }
}

// Rows [r0, r0 + R) of the block against one tile.
template <int R>
MHA_FLASH_BF16 void GroupTile(const FlashBf16Block& b, const Tile& t, int64_t r0,
                              const FlashBf16Scratch& scratch) {
  GroupProbs p;
  TileProbs<R>(b, t, r0, scratch, p);
  TileValues<R>(b, t, r0, scratch, p);
}

}  // namespace

bool FlashBf16Fits(int64_t dqk, int64_t dv) {
  return dqk > 0 && dqk % 2 == 0 && dv > 0 && dv % 16 == 0;
}

void FlashAttentionBf16(const FlashBf16Block& block, const FlashBf16Scratch& scratch) {
  FlashBf16Block b = block;
  if (block.q_stride > 0 && block.q_stride != block.dqk) {  // the rows side by side once
    for (int64_t r = 0; r < b.rows; ++r) {
      std::memcpy(scratch.q + r * b.dqk, block.q + r * block.q_stride, sizeof(uint16_t) * b.dqk);
    }
    b.q = scratch.q;
  }
  const int64_t k_stride = b.k_stride > 0 ? b.k_stride : b.dqk;
  const int64_t v_stride = b.v_stride > 0 ? b.v_stride : b.dv;
  std::fill_n(scratch.max, b.rows, kNegInf);
  std::fill_n(scratch.sum, b.rows, 0.0f);
  std::fill_n(scratch.acc, b.rows * b.dv, 0.0f);
  for (int64_t col0 = 0; col0 < b.keys; col0 += kTile) {
    Tile t;
    t.col0 = col0;
    t.cols = std::min(kTile, b.keys - col0);
    if (CausalMaskHides(b.masks, 0, b.rows, t.col0, t.cols)) continue;
    PackKeyTile(b.k + col0 * k_stride, k_stride, b.dqk, t.cols, scratch.key_pairs);
    PackValueTile(b.v + col0 * v_stride, v_stride, b.dv, t.cols, scratch.value_pairs);
    t.key_pairs = scratch.key_pairs;
    t.value_pairs = scratch.value_pairs;
    int64_t r0 = 0;
    for (; r0 + kGroup <= b.rows; r0 += kGroup) {
      if (!CausalMaskHides(b.masks, r0, kGroup, t.col0, t.cols)) {
        GroupTile<kGroup>(b, t, r0, scratch);
      }
    }
    switch (b.rows - r0) {
      case 3:
        GroupTile<3>(b, t, r0, scratch);
        break;
      case 2:
        GroupTile<2>(b, t, r0, scratch);
        break;
      case 1:
        GroupTile<1>(b, t, r0, scratch);
        break;
      default:
        break;
    }
  }
  NormalizeRows(scratch.acc, scratch.sum, b.rows, b.dv, /*bf16=*/true, b.context);
}

}  // namespace mha
