#include "engine/ops/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

#include "engine/ops/avx512_kernels.h"
#include "engine/ops/exp_polynomial.h"
#include "engine/ops/multiversion.h"
#include "engine/ops/parallel_for.h"

// Bodies shared by several multiversioned functions: inlined into each clone,
// so each is compiled for that clone's instruction set.
#define MHA_INLINE inline __attribute__((always_inline))

namespace mha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Softmax over fewer scores than this runs on the calling thread: below it
// waking the OpenMP team costs more than the rows.
constexpr int64_t kParallelSoftmaxScores = int64_t{1} << 15;

// SmallContextBf16 accumulates a context row this many columns at a time
// (an f32 accumulator on the stack).
constexpr int64_t kContextChunkCols = 1024;

// exp(x), written so the compiler vectorises it: to ~2 ulp, or with kBf16
// to ~4e-6 relative (a degree-4 polynomial, ~30 % cheaper: enough for
// probabilities that are rounded to bf16, 2^-9 relative, anyway). Exactly 0
// for x below the f32 range (so masked positions get probability 0), NaN
// for NaN.
template <bool kBf16 = false>
inline float VectorExp(float x) {
  // Plain comparisons, not std::fmin/fmax/nearbyint: those are library
  // calls that keep the loop scalar (10x slower). NaN fails both tests and
  // becomes -87, so the int conversion below is always defined.
  const float low = x > -87.0f ? x : -87.0f;
  const float clamped = low < 88.0f ? low : 88.0f;
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  constexpr float kRound = 12582912.0f;
  namespace c = exp_polynomial;
  const float n = (clamped * c::kLog2e + kRound) - kRound;
  float r = clamped - n * c::kLn2High;
  r = r - n * c::kLn2Low;
  constexpr const float* kCoefficients = kBf16 ? c::kBf16 : c::kAccurate;
  constexpr int kTerms = kBf16 ? std::size(c::kBf16) : std::size(c::kAccurate);
  float p = kCoefficients[0];
  for (int i = 1; i < kTerms; ++i) p = p * r + kCoefficients[i];
  if constexpr (!kBf16) p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float result = x < -87.0f ? 0.0f : p * scale;
  return x != x ? x : result;
}

// row[j] = exp(row[j] - max), returning their sum (in AVX-512 or AVX2
// intrinsics where the CPU has them); kBf16Only: with the cheaper exp of
// probabilities that feed a bf16 product only.
template <bool kBf16Only>
inline float ExpSum(float* row, int64_t cols, float max) {
  const KernelIsa isa = ActiveKernelIsa();
  if (isa >= KernelIsa::kAvx512) {
    return kBf16Only ? ExpSumAvx512(row, cols, max) : ExpSumAccurateAvx512(row, cols, max);
  }
  if (isa == KernelIsa::kAvx2) {
    return kBf16Only ? ExpSumAvx2(row, cols, max) : ExpSumAccurateAvx2(row, cols, max);
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < cols; ++j) {
    const float e = VectorExp<kBf16Only>(row[j] - max);
    row[j] = e;
    sum += e;
  }
  return sum;
}

inline uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// out[i] = bf16(in[i] * scale), in AVX-512 intrinsics where the CPU has them.
inline void ScaleToBf16(const float* in, float scale, uint16_t* out, int64_t count) {
  if (HasAvx512()) return ScaleToBf16Avx512(in, scale, out, count);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) out[i] = ToBf16(in[i] * scale);
}

// Adds the additive masks to the first `masked` columns of a score row and
// masks out those from `causal_limit` on. Inlined into each vectorised caller.
inline void AddMasks(float* row, const float* add_a, const float* add_b, int64_t masked,
                     int64_t causal_limit) {
  if (add_a != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < masked; ++j) row[j] += add_a[j];
  }
  if (add_b != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < masked; ++j) row[j] += add_b[j];
  }
  for (int64_t j = causal_limit; j < masked; ++j) row[j] = kNegInf;
}

// One row of MaskedSoftmax. kBf16Only: the probabilities go to `bf16_row`
// only (`row` keeps unnormalised values), computed with the cheaper exp.
template <bool kBf16Only>
MHA_INLINE void SoftmaxRowOf(float* row, int64_t cols, const float* add_a, const float* add_b,
                             int64_t masked_cols, int64_t causal_limit, uint16_t* bf16_row) {
  AddMasks(row, add_a, add_b, masked_cols, causal_limit);
  float max = kNegInf;
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < cols; ++j) max = row[j] > max ? row[j] : max;
  if (!(max < std::numeric_limits<float>::infinity()) || max == kNegInf) {
    // Every key masked: zero probabilities, never NaN. Scores that
    // overflowed (+inf or NaN: inputs too large for f32) give a NaN row,
    // which the caller reports rather than returns.
    if (max != kNegInf) {
      for (int64_t j = 0; j < cols; ++j) row[j] = std::numeric_limits<float>::quiet_NaN();
      if (bf16_row != nullptr) {
        for (int64_t j = 0; j < cols; ++j) bf16_row[j] = 0x7fc0;
      }
    } else {
      std::memset(row, 0, sizeof(float) * cols);
      if (bf16_row != nullptr) std::memset(bf16_row, 0, sizeof(uint16_t) * cols);
    }
    return;
  }
  const float inv = 1.0f / ExpSum<kBf16Only>(row, cols, max);
  if constexpr (kBf16Only) {
    ScaleToBf16(row, inv, bf16_row, cols);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) row[j] *= inv;
  if (bf16_row != nullptr) ScaleToBf16(row, 1.0f, bf16_row, cols);
}

// Template instances cannot be cloned per CPU (clang: "multiversioned
// functions do not yet support function templates"): plain wrappers are.
MHA_MULTIVERSION
void SoftmaxRow(float* row, int64_t cols, const float* add_a, const float* add_b,
                int64_t masked_cols, int64_t causal_limit, uint16_t* bf16_row) {
  SoftmaxRowOf<false>(row, cols, add_a, add_b, masked_cols, causal_limit, bf16_row);
}

MHA_MULTIVERSION
void SoftmaxRowBf16Only(float* row, int64_t cols, const float* add_a, const float* add_b,
                        int64_t masked_cols, int64_t causal_limit, uint16_t* bf16_row) {
  SoftmaxRowOf<true>(row, cols, add_a, add_b, masked_cols, causal_limit, bf16_row);
}

}  // namespace

void MaskedSoftmax(float* scores, int64_t heads, int64_t rows, int64_t cols, const SoftmaxMasks& m,
                   uint16_t* bf16_out, bool f32_probs) {
  const int64_t total_rows = heads * rows;
  const auto row_fn = bf16_out != nullptr && !f32_probs ? SoftmaxRowBf16Only : SoftmaxRow;
  ForRange(total_rows, total_rows * cols >= kParallelSoftmaxScores, [&](int64_t hr) {
    const int64_t h = hr / rows, r = hr % rows;
    const float* attn =
        m.attn == nullptr ? nullptr : m.attn + h * m.attn_head_stride + r * m.attn_row_stride;
    const int64_t causal_limit =
        m.causal ? std::min(m.masked_cols, m.first_row + r + 1) : m.masked_cols;
    row_fn(scores + hr * cols, cols, m.key_padding, attn, m.masked_cols, causal_limit,
           bf16_out == nullptr ? nullptr : bf16_out + hr * cols);
  });
}

namespace {

// One row of OnlineSoftmaxTile; `masked` and `causal_limit` are relative to
// the tile. kBf16Only: the probabilities also go to `bf16_row`, computed
// with the cheaper exp.
template <bool kBf16Only>
MHA_INLINE void OnlineSoftmaxRowOf(float* row, int64_t cols, const float* add_a, const float* add_b,
                                   int64_t masked, int64_t causal_limit, float& max, float& sum,
                                   float& rescale, uint16_t* bf16_row) {
  AddMasks(row, add_a, add_b, masked, causal_limit);
  float tile_max = kNegInf;
#pragma omp simd reduction(max : tile_max)
  for (int64_t j = 0; j < cols; ++j) tile_max = row[j] > tile_max ? row[j] : tile_max;
  const float new_max = tile_max > max ? tile_max : max;
  if (!(tile_max < std::numeric_limits<float>::infinity()) || new_max == kNegInf) {
    // Overflowed scores poison the row (NaN sum); keys all masked so far
    // add nothing. Either way this tile contributes zeros.
    if (tile_max != kNegInf) sum = std::numeric_limits<float>::quiet_NaN();
    rescale = 1.0f;
    std::memset(row, 0, sizeof(float) * cols);
    if (bf16_row != nullptr) std::memset(bf16_row, 0, sizeof(uint16_t) * cols);
    return;
  }
  rescale = VectorExp(max - new_max);  // 0 on the first contributing tile
  float tile_sum;
  if (kBf16Only && HasAvx512()) {
    tile_sum = ExpSumToBf16Avx512(row, cols, new_max, bf16_row);
  } else {
    tile_sum = ExpSum<kBf16Only>(row, cols, new_max);
    // bf16 rounding as a pass of its own: GCC leaves an exp, a bf16 store
    // and a sum in one loop scalar, 2x slower in all.
    if constexpr (kBf16Only) ScaleToBf16(row, 1.0f, bf16_row, cols);
  }
  sum = sum * rescale + tile_sum;
  max = new_max;
}

MHA_MULTIVERSION
void OnlineSoftmaxRow(float* row, int64_t cols, const float* add_a, const float* add_b,
                      int64_t masked, int64_t causal_limit, float& max, float& sum,
                      float& rescale) {
  OnlineSoftmaxRowOf<false>(row, cols, add_a, add_b, masked, causal_limit, max, sum, rescale,
                            nullptr);
}

MHA_MULTIVERSION
void OnlineSoftmaxRowBf16(float* row, int64_t cols, const float* add_a, const float* add_b,
                          int64_t masked, int64_t causal_limit, float& max, float& sum,
                          float& rescale, uint16_t* bf16_row) {
  OnlineSoftmaxRowOf<true>(row, cols, add_a, add_b, masked, causal_limit, max, sum, rescale,
                           bf16_row);
}

}  // namespace

void OnlineSoftmaxTile(float* scores, int64_t rows, int64_t cols, int64_t col0,
                       const SoftmaxMasks& m, const OnlineSoftmaxRows& state, uint16_t* bf16_out) {
  const int64_t masked = std::clamp<int64_t>(m.masked_cols - col0, 0, cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* pad = m.key_padding == nullptr ? nullptr : m.key_padding + col0;
    const float* attn = m.attn == nullptr ? nullptr : m.attn + r * m.attn_row_stride + col0;
    const int64_t causal_limit =
        m.causal ? std::clamp<int64_t>(m.first_row + r + 1 - col0, 0, masked) : masked;
    if (bf16_out != nullptr) {
      OnlineSoftmaxRowBf16(scores + r * cols, cols, pad, attn, masked, causal_limit, state.max[r],
                           state.sum[r], state.rescale[r], bf16_out + r * cols);
    } else {
      OnlineSoftmaxRow(scores + r * cols, cols, pad, attn, masked, causal_limit, state.max[r],
                       state.sum[r], state.rescale[r]);
    }
  }
}

MHA_MULTIVERSION
void RescaleAccumulate(float* acc, const float* product, const float* rescale, int64_t rows,
                       int64_t n, bool first) {
  if (first) {
    std::memcpy(acc, product, sizeof(float) * rows * n);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float f = rescale[r];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) acc[r * n + i] = acc[r * n + i] * f + product[r * n + i];
  }
}

MHA_MULTIVERSION
void NormalizeRows(const float* acc, const float* sum, int64_t rows, int64_t n, bool bf16,
                   void* out) {
  for (int64_t r = 0; r < rows; ++r) {
    // NaN sums (overflowed scores) give NaN outputs: 0 * NaN is NaN.
    const float inv = sum[r] == 0.0f ? 0.0f : 1.0f / sum[r];
    const float* a = acc + r * n;
    if (bf16) {
      ScaleToBf16(a, inv, static_cast<uint16_t*>(out) + r * n, n);
    } else {
      float* o = static_cast<float*>(out) + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = a[i] * inv;
    }
  }
}

MHA_MULTIVERSION
void AddLayerNorm(float* out, const float* residual, const float* gamma, const float* beta,
                  int64_t rows, int64_t n, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    float* x = out + t * n;
    const float* res = residual + t * n;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      x[i] += res[i];
      sum += x[i];
    }
    const float mean = sum / static_cast<float>(n);
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    const float inv_std = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = (x[i] - mean) * inv_std * gamma[i] + beta[i];
  }
}

namespace {

MHA_MULTIVERSION
void ConvertChunkToBf16(const float* in, uint16_t* out, int64_t count) {
  ScaleToBf16(in, 1.0f, out, count);
}

// Copies `bytes` (a multiple of 2) with inline fixed-size moves: the head
// slices SplitHeads and MergeHeads move are 16-512 bytes, where a memcpy
// call per slice costs more than the copy.
inline void CopySlice(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) std::memcpy(dst + i, src + i, 64);
  for (; i + 16 <= bytes; i += 16) std::memcpy(dst + i, src + i, 16);
  for (; i + 2 <= bytes; i += 2) std::memcpy(dst + i, src + i, 2);
}

}  // namespace

void ConvertToBf16(const float* in, uint16_t* out, int64_t count) {
  constexpr int64_t kChunk = 16 << 10;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  ForRange(chunks, count * 4 > kParallelCopyBytes, [&](int64_t c) {
    const int64_t first = c * kChunk;
    ConvertChunkToBf16(in + first, out + first, std::min(kChunk, count - first));
  });
}

void SplitHeads(const uint8_t* src, int64_t src_row_bytes, int64_t rows, const HeadLayout& layout,
                uint8_t* dst) {
  const int64_t hb = layout.head_bytes;
  ForRange(rows, rows * layout.heads * hb > kParallelCopyBytes, [&](int64_t r) {
    for (int64_t h = 0; h < layout.heads; ++h) {
      CopySlice(dst + layout.Offset(h, r), src + r * src_row_bytes + h * hb, hb);
    }
  });
}

void MergeHeads(const uint8_t* src, const HeadLayout& layout, int64_t rows, uint8_t* dst,
                int64_t dst_row_bytes) {
  const int64_t hb = layout.head_bytes;
  ForRange(rows, rows * layout.heads * hb > kParallelCopyBytes, [&](int64_t r) {
    for (int64_t h = 0; h < layout.heads; ++h) {
      CopySlice(dst + r * dst_row_bytes + h * hb, src + layout.Offset(h, r), hb);
    }
  });
}

MHA_MULTIVERSION
void SmallScores(const float* q, const float* k, float* scores, int64_t batch, int64_t rows,
                 int64_t cols, int64_t d, float scale) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* qi = q + (b * rows + i) * d;
      for (int64_t j = 0; j < cols; ++j) {
        const float* kj = k + (b * cols + j) * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qi[c] * kj[c];
        scores[(b * rows + i) * cols + j] = dot * scale;
      }
    }
  }
}

MHA_MULTIVERSION
void SmallContext(const float* probs, const float* v, float* context, int64_t batch, int64_t rows,
                  int64_t cols, int64_t dv) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      float* out = context + (b * rows + i) * dv;
      for (int64_t c = 0; c < dv; ++c) out[c] = 0.0f;
      for (int64_t j = 0; j < cols; ++j) {
        const float p = probs[(b * rows + i) * cols + j];
        const float* vj = v + (b * cols + j) * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) out[c] += p * vj[c];
      }
    }
  }
}

inline float Bf16Bits(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

MHA_MULTIVERSION
void SmallScoresBf16(const uint16_t* q, const uint16_t* k, float* scores, int64_t batch,
                     int64_t rows, int64_t cols, int64_t d, float scale) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const uint16_t* qi = q + (b * rows + i) * d;
      for (int64_t j = 0; j < cols; ++j) {
        const uint16_t* kj = k + (b * cols + j) * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += Bf16Bits(qi[c]) * Bf16Bits(kj[c]);
        scores[(b * rows + i) * cols + j] = dot * scale;
      }
    }
  }
}

MHA_MULTIVERSION
void SmallContextBf16(const float* probs, const uint16_t* v, uint16_t* context, int64_t batch,
                      int64_t rows, int64_t cols, int64_t dv) {
  float acc[kContextChunkCols];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c0 = 0; c0 < dv; c0 += kContextChunkCols) {
        const int64_t n = std::min<int64_t>(kContextChunkCols, dv - c0);
        for (int64_t c = 0; c < n; ++c) acc[c] = 0.0f;
        for (int64_t j = 0; j < cols; ++j) {
          const float p = probs[(b * rows + i) * cols + j];
          const uint16_t* vj = v + (b * cols + j) * dv + c0;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) acc[c] += p * Bf16Bits(vj[c]);
        }
        uint16_t* out = context + (b * rows + i) * dv + c0;
        for (int64_t c = 0; c < n; ++c) out[c] = ToBf16(acc[c]);
      }
    }
  }
}

// 16 floats as one vector of the clone's width (one AVX-512 register, two
// AVX2 ones); loads and stores need no alignment.
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));

inline float ValueAsFloat(float x) { return x; }
inline float ValueAsFloat(uint16_t x) { return Bf16Bits(x); }

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
  auto qc = [&](int64_t c) { return q_f32 != nullptr ? q_f32[c] : Bf16Bits(q_bf16[c]); };
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
  auto qc = [&](int64_t c) { return q_f32 != nullptr ? q_f32[c] : Bf16Bits(q_bf16[c]); };
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
    for (int64_t c = c0; c < dv; ++c) acc[c] += p * Bf16Bits(vj[c]);
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

void AccumulateHeadMean(const float* probs, int64_t heads, int64_t total_heads, int64_t rows,
                        int64_t cols, bool first, float* weights) {
  const int64_t n = rows * cols;
  const float inv = 1.0f / static_cast<float>(total_heads);
  for (int64_t h = 0; h < heads; ++h) {
    const float* head = probs + h * n;
    if (first && h == 0) {
      for (int64_t i = 0; i < n; ++i) weights[i] = head[i] * inv;
    } else {
      for (int64_t i = 0; i < n; ++i) weights[i] += head[i] * inv;
    }
  }
}

}  // namespace mha
