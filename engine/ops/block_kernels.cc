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
// overlaps), added at the end.
constexpr int64_t kBlockScoreTokens = 32;

template <typename Key, typename AddRow>
__attribute__((always_inline)) inline void BlockScoresWith(const float* q_f32,
                                                           const uint16_t* q_bf16, const Key* kt,
                                                           float* out, int64_t n, int64_t d,
                                                           float scale, const void* next,
                                                           AddRow add_row) {
  Floats16 l0 = {}, l1 = {}, l2 = {}, l3 = {}, h0 = {}, h1 = {}, h2 = {}, h3 = {};
  auto qc = [&](int64_t c) { return q_f32 != nullptr ? q_f32[c] : Bf16ToFloat(q_bf16[c]); };
  if (next == nullptr) next = kt;
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    const Key* r = kt + c * kBlockScoreTokens;
    FetchNext<4 * kBlockScoreTokens * sizeof(Key)>(next, c * kBlockScoreTokens * sizeof(Key));
    add_row(l0, h0, qc(c), r);
    add_row(l1, h1, qc(c + 1), r + kBlockScoreTokens);
    add_row(l2, h2, qc(c + 2), r + 2 * kBlockScoreTokens);
    add_row(l3, h3, qc(c + 3), r + 3 * kBlockScoreTokens);
  }
  for (; c < d; ++c) add_row(l0, h0, qc(c), kt + c * kBlockScoreTokens);
  const Floats16 lo = (l0 + l1) + (l2 + l3), hi = (h0 + h1) + (h2 + h3);
  float sums[kBlockScoreTokens];
  std::memcpy(sums, &lo, sizeof lo);
  std::memcpy(sums + 16, &hi, sizeof hi);
  for (int64_t j = 0; j < n; ++j) out[j] = sums[j] * scale;
}

MHA_MULTIVERSION
void BlockScores(const float* q, const float* kt, float* out, int64_t n, int64_t d, float scale,
                 const void* next) {
  BlockScoresWith(q, nullptr, kt, out, n, d, scale, next,
                  [](Floats16& lo, Floats16& hi, float qc, const float* row) {
                    AddFloats16(lo, qc, row);
                    AddFloats16(hi, qc, row + 16);
                  });
}

// 32 bf16 values as 16 words: the even-indexed values are the low halves
// (shifted up, they are floats), the odd-indexed ones the high halves
// (masked). One load and two bit operations, no shuffle across lanes.
typedef uint32_t Words16 __attribute__((vector_size(64), aligned(2)));
constexpr uint32_t kHighHalf = 0xFFFF0000u;

// Scores of a bf16 block, the even tokens' sums in `even`, the odd ones'
// in `odd` (four chains each), interleaved back at the end.
__attribute__((always_inline)) inline void Bf16BlockScores(const float* q_f32,
                                                           const uint16_t* q_bf16,
                                                           const uint16_t* kt, float* out,
                                                           int64_t n, int64_t d, float scale,
                                                           const void* next) {
  Floats16 e0 = {}, e1 = {}, e2 = {}, e3 = {}, o0 = {}, o1 = {}, o2 = {}, o3 = {};
  if (next == nullptr) next = kt;
  auto qc = [&](int64_t c) { return q_f32 != nullptr ? q_f32[c] : Bf16ToFloat(q_bf16[c]); };
  auto add = [](Floats16& even, Floats16& odd, float q, const uint16_t* row) {
    const Words16 w = *reinterpret_cast<const Words16*>(row);
    even += q * (Floats16)(w << 16);
    odd += q * (Floats16)(w & kHighHalf);
  };
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    const uint16_t* r = kt + c * kBlockScoreTokens;
    FetchNext<4 * kBlockScoreTokens * 2>(next, c * kBlockScoreTokens * 2);
    add(e0, o0, qc(c), r);
    add(e1, o1, qc(c + 1), r + kBlockScoreTokens);
    add(e2, o2, qc(c + 2), r + 2 * kBlockScoreTokens);
    add(e3, o3, qc(c + 3), r + 3 * kBlockScoreTokens);
  }
  for (; c < d; ++c) add(e0, o0, qc(c), kt + c * kBlockScoreTokens);
  const Floats16 even = (e0 + e1) + (e2 + e3), odd = (o0 + o1) + (o2 + o3);
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
// multiply-adds), added at the end. `add` is one row's 16 values into a sum.
template <typename Value, typename Add>
__attribute__((always_inline)) inline void AccumulateContextWith(const float* probs, const Value* v,
                                                                 float* acc, int64_t cols,
                                                                 int64_t dv, const void* next,
                                                                 Add add) {
  if (next == nullptr) next = v;
  constexpr int kRowBytes = 64 * sizeof(Value);  // one row's 64 columns
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) {
    Floats16 a0 = *reinterpret_cast<const Floats16*>(acc + c0);
    Floats16 a1 = *reinterpret_cast<const Floats16*>(acc + c0 + 16);
    Floats16 a2 = *reinterpret_cast<const Floats16*>(acc + c0 + 32);
    Floats16 a3 = *reinterpret_cast<const Floats16*>(acc + c0 + 48);
    Floats16 b0 = {}, b1 = {}, b2 = {}, b3 = {};
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      const Value* x = v + j * dv + c0;
      const Value* y = x + dv;
      FetchNext<kRowBytes>(next, (j * dv + c0) * sizeof(Value));
      FetchNext<kRowBytes>(next, ((j + 1) * dv + c0) * sizeof(Value));
      add(a0, probs[j], x);
      add(a1, probs[j], x + 16);
      add(a2, probs[j], x + 32);
      add(a3, probs[j], x + 48);
      add(b0, probs[j + 1], y);
      add(b1, probs[j + 1], y + 16);
      add(b2, probs[j + 1], y + 32);
      add(b3, probs[j + 1], y + 48);
    }
    if (j < cols) {
      const Value* x = v + j * dv + c0;
      add(a0, probs[j], x);
      add(a1, probs[j], x + 16);
      add(a2, probs[j], x + 32);
      add(a3, probs[j], x + 48);
    }
    *reinterpret_cast<Floats16*>(acc + c0) = a0 + b0;
    *reinterpret_cast<Floats16*>(acc + c0 + 16) = a1 + b1;
    *reinterpret_cast<Floats16*>(acc + c0 + 32) = a2 + b2;
    *reinterpret_cast<Floats16*>(acc + c0 + 48) = a3 + b3;
  }
  if (c0 == dv) return;
  for (int64_t j = 0; j < cols; ++j) {
    const float p = probs[j];
    const Value* vj = v + j * dv;
    for (int64_t c = c0; c < dv; ++c) acc[c] += p * ValueAsFloat(vj[c]);
  }
}

MHA_MULTIVERSION
void AccumulateContext(const float* probs, const float* v, float* acc, int64_t cols, int64_t dv,
                       const void* next) {
  AccumulateContextWith(probs, v, acc, cols, dv, next,
                        [](Floats16& sum, float p, const float* x) { AddFloats16(sum, p, x); });
}

MHA_MULTIVERSION
void AccumulateContextBf16(const float* probs, const uint16_t* v, float* acc, int64_t cols,
                           int64_t dv, const void* next) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return AccumulateContextBf16Dot(probs, v, acc, cols, dv, next);
  }
  if (next == nullptr) next = v;
  int64_t c0 = 0;
  // 64 columns at a time as even and odd columns (Words16), so a row is two
  // loads, into sums kept split the same way in `acc` (see
  // MergeSplitContext): [even 0..30, odd 1..31, even 32..62, odd 33..63].
  for (; c0 + 64 <= dv; c0 += 64) {
    Floats16 e0 = *reinterpret_cast<const Floats16*>(acc + c0);
    Floats16 o0 = *reinterpret_cast<const Floats16*>(acc + c0 + 16);
    Floats16 e1 = *reinterpret_cast<const Floats16*>(acc + c0 + 32);
    Floats16 o1 = *reinterpret_cast<const Floats16*>(acc + c0 + 48);
    Floats16 f0 = {}, p0 = {}, f1 = {}, p1 = {};  // the odd rows' sums
    auto add = [](Floats16& even, Floats16& odd, float p, const uint16_t* x) {
      const Words16 w = *reinterpret_cast<const Words16*>(x);
      even += p * (Floats16)(w << 16);
      odd += p * (Floats16)(w & kHighHalf);
    };
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) {
      const uint16_t* x = v + j * dv + c0;
      FetchNext<128>(next, (j * dv + c0) * 2);  // two rows' 64 columns
      FetchNext<128>(next, ((j + 1) * dv + c0) * 2);
      add(e0, o0, probs[j], x);
      add(e1, o1, probs[j], x + 32);
      add(f0, p0, probs[j + 1], x + dv);
      add(f1, p1, probs[j + 1], x + dv + 32);
    }
    if (j < cols) {
      const uint16_t* x = v + j * dv + c0;
      add(e0, o0, probs[j], x);
      add(e1, o1, probs[j], x + 32);
    }
    *reinterpret_cast<Floats16*>(acc + c0) = e0 + f0;
    *reinterpret_cast<Floats16*>(acc + c0 + 16) = o0 + p0;
    *reinterpret_cast<Floats16*>(acc + c0 + 32) = e1 + f1;
    *reinterpret_cast<Floats16*>(acc + c0 + 48) = o1 + p1;
  }
  for (int64_t j = 0; j < cols && c0 < dv; ++j) {  // the rest, in order
    const float p = probs[j];
    const uint16_t* vj = v + j * dv;
    for (int64_t c = c0; c < dv; ++c) acc[c] += p * Bf16ToFloat(vj[c]);
  }
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
