// The layout kernels: f32 rows to bf16, a projection's rows into heads and
// back, and the average of the heads' attention weights.
#include <algorithm>
#include <cstring>

#include "engine/ops/bf16_rows.h"
#include "engine/ops/kernels.h"
#include "engine/ops/multiversion.h"
#include "engine/ops/parallel_for.h"

namespace mha {
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
