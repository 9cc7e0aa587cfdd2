// The softmax kernels: masked softmax over whole score rows, the online
// (tiled) softmax with its rescale and normalisation, and the post-norm
// block's residual + LayerNorm.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

#include "engine/ops/avx512_kernels.h"
#include "engine/ops/bf16_rows.h"
#include "engine/ops/exp_polynomial.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"
#include "engine/ops/parallel_for.h"

namespace mha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Softmax over fewer scores than this runs on the calling thread: below it
// waking the OpenMP team costs more than the rows.
constexpr int64_t kParallelSoftmaxScores = int64_t{1} << 15;

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

// The largest of `cols` scores; -inf when every one is -inf (masked). An
// `omp simd` max reduction starts each lane at the type's lowest value,
// which GCC takes as -inf and clang as -FLT_MAX: under clang a row of masked
// keys read -FLT_MAX (then a zero sum and NaN probabilities), so that one
// result is checked again without the reduction.
MHA_INLINE float RowMax(const float* row, int64_t cols) {
  float max = kNegInf;
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < cols; ++j) max = row[j] > max ? row[j] : max;
  if (max == -std::numeric_limits<float>::max()) {
    max = kNegInf;
    for (int64_t j = 0; j < cols; ++j) max = row[j] > max ? row[j] : max;
  }
  return max;
}

// One row of MaskedSoftmax. kBf16Only: the probabilities go to `bf16_row`
// only (`row` keeps unnormalised values), computed with the cheaper exp.
template <bool kBf16Only>
MHA_INLINE void SoftmaxRowOf(float* row, int64_t cols, const float* add_a, const float* add_b,
                             int64_t masked_cols, int64_t causal_limit, uint16_t* bf16_row) {
  AddMasks(row, add_a, add_b, masked_cols, causal_limit);
  const float max = RowMax(row, cols);
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
  const bool bf16_only = bf16_out != nullptr && !f32_probs;
  auto row_of = [&](int64_t hr) {
    const int64_t h = hr / rows, r = hr % rows;
    ShortSoftmaxRow row;
    row.scores = scores + hr * cols;
    row.add_b =
        m.attn == nullptr ? nullptr : m.attn + h * m.attn_head_stride + r * m.attn_row_stride;
    row.causal_limit = m.causal ? std::min(m.masked_cols, m.first_row + r + 1) : m.masked_cols;
    row.bf16 = bf16_out == nullptr ? nullptr : bf16_out + hr * cols;
    return row;
  };
  // Short rows in registers, four at a time: passes over memory and one
  // row's chain of reductions cost more than their arithmetic (EPYC VM, 4
  // heads x 16 rows of 16: 1.28 -> 0.7-1.0 us; of 22 x 22: 4.6 -> 1.8 us).
  if (cols <= kShortSoftmaxCols && HasAvx512()) {
    const int64_t groups = (total_rows + kShortSoftmaxRows - 1) / kShortSoftmaxRows;
    ForRange(groups, total_rows * cols >= kParallelSoftmaxScores, [&](int64_t g) {
      ShortSoftmaxRow group[kShortSoftmaxRows];
      const int n = static_cast<int>(
          std::min<int64_t>(kShortSoftmaxRows, total_rows - g * kShortSoftmaxRows));
      for (int i = 0; i < n; ++i) group[i] = row_of(g * kShortSoftmaxRows + i);
      SoftmaxShortRowsAvx512(group, n, cols, m.key_padding, m.masked_cols, bf16_only);
    });
    return;
  }
  const auto row_fn = bf16_only ? SoftmaxRowBf16Only : SoftmaxRow;
  ForRange(total_rows, total_rows * cols >= kParallelSoftmaxScores, [&](int64_t hr) {
    const ShortSoftmaxRow row = row_of(hr);
    row_fn(row.scores, cols, m.key_padding, row.add_b, m.masked_cols, row.causal_limit, row.bf16);
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
  const float tile_max = RowMax(row, cols);
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
                       int64_t n) {
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

}  // namespace mha
