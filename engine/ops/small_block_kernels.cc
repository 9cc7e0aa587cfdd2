// The small-block kernels: scores and context of short sequences, whole
// heads at once, in f32 or bf16 (the engine's small path, below oneDNN's
// break-even).
#include <algorithm>
#include <cstring>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"

namespace mha {
namespace {

// SmallContextBf16 accumulates a context row this many columns at a time
// (an f32 accumulator on the stack).
constexpr int64_t kContextChunkCols = 1024;

MHA_INLINE float AsFloat(float x) { return x; }
MHA_INLINE float AsFloat(uint16_t bf16) { return Bf16ToFloat(bf16); }

// Keys are taken this many at a time, transposed to f32 (heads up to
// kMaxTiledDepth deep): each query row's scores against them then gather in
// one vector, where a dot product per key ended in a horizontal sum.
constexpr int64_t kKeyTile = 16;
constexpr int64_t kMaxTiledDepth = 256;

// scores[b, i, j] = scale * q[b, i] . k[b, j], one dot product at a time
// (heads deeper than kMaxTiledDepth).
template <typename T>
MHA_INLINE void DotScores(const T* q, const T* k, float* scores, int64_t batch, int64_t rows,
                          int64_t cols, int64_t d, float scale) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const T* qi = q + (b * rows + i) * d;
      for (int64_t j = 0; j < cols; ++j) {
        const T* kj = k + (b * cols + j) * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += AsFloat(qi[c]) * AsFloat(kj[c]);
        scores[(b * rows + i) * cols + j] = dot * scale;
      }
    }
  }
}

// The same, kKeyTile keys at a time: `kt` holds the tile's keys transposed
// ([d][kKeyTile]; past the last key, copies of it, whose scores are not
// written).
template <typename T>
MHA_INLINE void TiledScores(const T* q, const T* k, float* scores, int64_t batch, int64_t rows,
                            int64_t cols, int64_t d, float scale) {
  alignas(64) float kt[kMaxTiledDepth * kKeyTile];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j0 = 0; j0 < cols; j0 += kKeyTile) {
      const int64_t nj = std::min(kKeyTile, cols - j0);
      for (int64_t j = 0; j < kKeyTile; ++j) {
        const T* kj = k + (b * cols + j0 + std::min(j, nj - 1)) * d;
        for (int64_t c = 0; c < d; ++c) kt[c * kKeyTile + j] = AsFloat(kj[c]);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const T* qi = q + (b * rows + i) * d;
        float acc[kKeyTile] = {};
        for (int64_t c = 0; c < d; ++c) {
          const float qc = AsFloat(qi[c]);
#pragma omp simd
          for (int64_t j = 0; j < kKeyTile; ++j) acc[j] += qc * kt[c * kKeyTile + j];
        }
        float* out = scores + (b * rows + i) * cols + j0;
        for (int64_t j = 0; j < nj; ++j) out[j] = acc[j] * scale;
      }
    }
  }
}

// scores[b, i, j] = scale * q[b, i] . k[b, j], in f32 whatever `T` (f32 or
// bf16); inlined into each clone of its callers.
template <typename T>
MHA_INLINE void ScoresOf(const T* q, const T* k, float* scores, int64_t batch, int64_t rows,
                         int64_t cols, int64_t d, float scale) {
  if (d > kMaxTiledDepth) return DotScores(q, k, scores, batch, rows, cols, d, scale);
  TiledScores(q, k, scores, batch, rows, cols, d, scale);
}

}  // namespace

MHA_MULTIVERSION
void SmallScores(const float* q, const float* k, float* scores, int64_t batch, int64_t rows,
                 int64_t cols, int64_t d, float scale) {
  ScoresOf(q, k, scores, batch, rows, cols, d, scale);
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

MHA_MULTIVERSION
void SmallScoresBf16(const uint16_t* q, const uint16_t* k, float* scores, int64_t batch,
                     int64_t rows, int64_t cols, int64_t d, float scale) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16 && d % 2 == 0 && d <= kSmallDotMaxDepth) {
    return SmallScoresBf16Dot(q, k, scores, batch, rows, cols, d, scale);
  }
  ScoresOf(q, k, scores, batch, rows, cols, d, scale);
}

MHA_MULTIVERSION
void SmallContextBf16(const float* probs, const uint16_t* v, uint16_t* context, int64_t batch,
                      int64_t rows, int64_t cols, int64_t dv) {
  if (ActiveKernelIsa() == KernelIsa::kAvx512Bf16) {
    return SmallContextBf16Dot(probs, v, context, batch, rows, cols, dv);
  }
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
          for (int64_t c = 0; c < n; ++c) acc[c] += p * Bf16ToFloat(vj[c]);
        }
        uint16_t* out = context + (b * rows + i) * dv + c0;
        for (int64_t c = 0; c < n; ++c) out[c] = FloatToBf16(acc[c]);
      }
    }
  }
}

}  // namespace mha
