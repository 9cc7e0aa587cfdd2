// The block kernels of session steps: scores against a cache block of 32
// tokens (f32 or bf16 keys, transposed) and the context accumulated over
// value blocks, as vector code of the clone's width.
#include <algorithm>
#include <cstring>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"

namespace mha {

// 16 floats as one vector of the clone's width (one AVX-512 register, two
// AVX2 ones); loads and stores need no alignment.
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));

inline float ValueAsFloat(float x) { return x; }
inline float ValueAsFloat(uint16_t x) { return Bf16ToFloat(x); }

__attribute__((always_inline)) inline void AddFloats16(Floats16& sum, float p,
                                                       const float* values) {
  sum += p * *reinterpret_cast<const Floats16*>(values);
}
// sum += p * (16 bf16 values widened to f32: their bits in the high half).
// By reference, inlined: a 64-byte vector never crosses a call.
typedef uint16_t Bf16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t Bits16 __attribute__((vector_size(64)));
__attribute__((always_inline)) inline void AddBf16x16(Floats16& sum, float p,
                                                      const uint16_t* values) {
  const Bits16 wide = __builtin_convertvector(*reinterpret_cast<const Bf16x16*>(values), Bits16)
                      << 16;
  sum += p * (Floats16)wide;  // the same bits, seen as floats
}

// kBlockTokens (32) scores per block, [d, 32] keys: four pairs of vector
// sums (four independent chains of multiply-adds, so their latency
// overlaps), added at the end. `add_row(first, second, q[c], row)` adds
// the products of key row c into a pair of sums; the pair's totals land in
// `first` and `second`.
constexpr int64_t kBlockScoreTokens = 32;

template <typename Key, typename AddRow>
__attribute__((always_inline)) inline void BlockScoresWith(const float* q_f32,
                                                           const uint16_t* q_bf16, const Key* kt,
                                                           int64_t d, const void* next,
                                                           AddRow add_row, Floats16& first,
                                                           Floats16& second) {
  Floats16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  auto qc = [&](int64_t c) { return q_f32 != nullptr ? q_f32[c] : Bf16ToFloat(q_bf16[c]); };
  if (next == nullptr) next = kt;
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    const Key* r = kt + c * kBlockScoreTokens;
    FetchNext<4 * kBlockScoreTokens * sizeof(Key)>(next, c * kBlockScoreTokens * sizeof(Key));
    add_row(a0, b0, qc(c), r);
    add_row(a1, b1, qc(c + 1), r + kBlockScoreTokens);
    add_row(a2, b2, qc(c + 2), r + 2 * kBlockScoreTokens);
    add_row(a3, b3, qc(c + 3), r + 3 * kBlockScoreTokens);
  }
  for (; c < d; ++c) add_row(a0, b0, qc(c), kt + c * kBlockScoreTokens);
  first = (a0 + a1) + (a2 + a3);
  second = (b0 + b1) + (b2 + b3);
}

// f32 keys: the sums of the low and the high 16 tokens.
MHA_MULTIVERSION
void BlockScores(const float* q, const float* kt, float* out, int64_t n, int64_t d, float scale,
                 const void* next) {
  Floats16 lo, hi;
  BlockScoresWith(
      q, nullptr, kt, d, next,
      [](Floats16& low, Floats16& high, float qc, const float* row) {
        AddFloats16(low, qc, row);
        AddFloats16(high, qc, row + 16);
      },
      lo, hi);
  float sums[kBlockScoreTokens];
  std::memcpy(sums, &lo, sizeof lo);
  std::memcpy(sums + 16, &hi, sizeof hi);
  for (int64_t j = 0; j < n; ++j) out[j] = sums[j] * scale;
}

// 32 bf16 values as 16 words: the even-indexed values are the low halves
// (shifted up, they are floats), the odd-indexed ones the high halves
// (masked). One load and two bit operations, no shuffle across lanes.
typedef uint32_t Words16 __attribute__((vector_size(64), aligned(2)));
constexpr uint32_t kHighHalf = 0xFFFF0000u;

// even += p * (the even-indexed of 32 bf16 values), odd += p * (the odd ones).
__attribute__((always_inline)) inline void AddBf16Pairs(Floats16& even, Floats16& odd, float p,
                                                        const uint16_t* values) {
  const Words16 w = *reinterpret_cast<const Words16*>(values);
  even += p * (Floats16)(w << 16);
  odd += p * (Floats16)(w & kHighHalf);
}

// Scores of a bf16 block, the even tokens' sums in `even`, the odd ones'
// in `odd`, interleaved back at the end.
__attribute__((always_inline)) inline void Bf16BlockScores(const float* q_f32,
                                                           const uint16_t* q_bf16,
                                                           const uint16_t* kt, float* out,
                                                           int64_t n, int64_t d, float scale,
                                                           const void* next) {
  Floats16 even, odd;
  BlockScoresWith(
      q_f32, q_bf16, kt, d, next,
      [](Floats16& evens, Floats16& odds, float q, const uint16_t* row) {
        AddBf16Pairs(evens, odds, q, row);
      },
      even, odd);
  float ev[16], od[16];
  std::memcpy(ev, &even, sizeof ev);
  std::memcpy(od, &odd, sizeof od);
  for (int64_t j = 0; j < n; ++j) out[j] = ((j & 1) != 0 ? od[j / 2] : ev[j / 2]) * scale;
}

MHA_MULTIVERSION
void BlockScoresF32Bf16(const float* q, const uint16_t* kt, float* out, int64_t n, int64_t d,
                        float scale, const void* next) {
  Bf16BlockScores(q, nullptr, kt, out, n, d, scale, next);
}

MHA_MULTIVERSION
void BlockScoresBf16(const uint16_t* q, const uint16_t* kt, float* out, int64_t n, int64_t d,
                     float scale, const void* next) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return BlockScoresBf16Dot(q, kt, out, n, d, scale, next);
  }
  Bf16BlockScores(nullptr, q, kt, out, n, d, scale, next);
}

// acc[c] += sum_j probs[j] * v[j][c] over `cols` rows of `dv` values:
// 64 columns at a time, their sums in registers while the rows stream by,
// two rows at a time into two sets of sums (independent chains of
// multiply-adds), added at the end. `add_row(s0, s1, s2, s3, p, x)` adds p
// times one row's 64 values from x into the four sums, as `acc` keeps
// them (16 each); the columns past the last 64 one by one, in order.
template <typename Value, typename AddRow>
__attribute__((always_inline)) inline void AccumulateContextWith(const float* probs, const Value* v,
                                                                 float* acc, int64_t cols,
                                                                 int64_t dv, const void* next,
                                                                 AddRow add_row) {
  if (next == nullptr) next = v;
  constexpr int kRowBytes = 64 * sizeof(Value);  // one row's 64 columns
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) {
    Floats16 a0 = *reinterpret_cast<const Floats16*>(acc + c0);
    Floats16 a1 = *reinterpret_cast<const Floats16*>(acc + c0 + 16);
    Floats16 a2 = *reinterpret_cast<const Floats16*>(acc + c0 + 32);
    Floats16 a3 = *reinterpret_cast<const Floats16*>(acc + c0 + 48);
    Floats16 b0 = {}, b1 = {}, b2 = {}, b3 = {};  // the odd rows' sums
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      const Value* x = v + j * dv + c0;
      FetchNext<kRowBytes>(next, (j * dv + c0) * sizeof(Value));
      FetchNext<kRowBytes>(next, ((j + 1) * dv + c0) * sizeof(Value));
      add_row(a0, a1, a2, a3, probs[j], x);
      add_row(b0, b1, b2, b3, probs[j + 1], x + dv);
    }
    if (j < cols) add_row(a0, a1, a2, a3, probs[j], v + j * dv + c0);
    *reinterpret_cast<Floats16*>(acc + c0) = a0 + b0;
    *reinterpret_cast<Floats16*>(acc + c0 + 16) = a1 + b1;
    *reinterpret_cast<Floats16*>(acc + c0 + 32) = a2 + b2;
    *reinterpret_cast<Floats16*>(acc + c0 + 48) = a3 + b3;
  }
  for (int64_t j = 0; j < cols && c0 < dv; ++j) {
    const float p = probs[j];
    const Value* vj = v + j * dv;
    for (int64_t c = c0; c < dv; ++c) acc[c] += p * ValueAsFloat(vj[c]);
  }
}

MHA_MULTIVERSION
void AccumulateContext(const float* probs, const float* v, float* acc, int64_t cols, int64_t dv,
                       const void* next) {
  AccumulateContextWith(
      probs, v, acc, cols, dv, next,
      [](Floats16& s0, Floats16& s1, Floats16& s2, Floats16& s3, float p, const float* x) {
        AddFloats16(s0, p, x);
        AddFloats16(s1, p, x + 16);
        AddFloats16(s2, p, x + 32);
        AddFloats16(s3, p, x + 48);
      });
}

MHA_MULTIVERSION
void AccumulateContextBf16(const float* probs, const uint16_t* v, float* acc, int64_t cols,
                           int64_t dv, const void* next) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return AccumulateContextBf16Dot(probs, v, acc, cols, dv, next);
  }
  // 64 columns at a time as even and odd columns (Words16), so a row is two
  // loads, into sums kept split the same way in `acc` (see
  // MergeSplitContext): [even 0..30, odd 1..31, even 32..62, odd 33..63].
  AccumulateContextWith(probs, v, acc, cols, dv, next,
                        [](Floats16& even0, Floats16& odd0, Floats16& even1, Floats16& odd1,
                           float p, const uint16_t* x) {
                          AddBf16Pairs(even0, odd0, p, x);
                          AddBf16Pairs(even1, odd1, p, x + 32);
                        });
}

void MergeSplitContext(float* acc, int64_t dv) {
  float split[64];
  for (int64_t c0 = 0; c0 + 64 <= dv; c0 += 64) {
    std::memcpy(split, acc + c0, sizeof split);
    for (int i = 0; i < 16; ++i) {
      acc[c0 + 2 * i] = split[i];
      acc[c0 + 2 * i + 1] = split[16 + i];
      acc[c0 + 32 + 2 * i] = split[32 + i];
      acc[c0 + 32 + 2 * i + 1] = split[48 + i];
    }
  }
}

}  // namespace mha
