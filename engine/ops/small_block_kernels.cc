// The small-block kernels: scores and context of short sequences, whole
// heads at once, in f32 or bf16 (the engine's small path, below oneDNN's
// break-even).
#include <algorithm>
#include <cstring>

#include "engine/dtype.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"

namespace mha {
namespace {

// SmallContextBf16 accumulates a context row this many columns at a time
// (an f32 accumulator on the stack).
constexpr int64_t kContextChunkCols = 1024;

MHA_INLINE float AsFloat(float x) { return x; }
MHA_INLINE float AsFloat(uint16_t bf16) { return Bf16ToFloat(bf16); }

// scores[b, i, j] = scale * q[b, i] . k[b, j], in f32 whatever `T` (f32 or
// bf16); inlined into each clone of its callers.
template <typename T>
MHA_INLINE void ScoresOf(const T* q, const T* k, float* scores, int64_t batch, int64_t rows,
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
  ScoresOf(q, k, scores, batch, rows, cols, d, scale);
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
          for (int64_t c = 0; c < n; ++c) acc[c] += p * Bf16ToFloat(vj[c]);
        }
        uint16_t* out = context + (b * rows + i) * dv + c0;
        for (int64_t c = 0; c < n; ++c) out[c] = FloatToBf16(acc[c]);
      }
    }
  }
}

}  // namespace mha
