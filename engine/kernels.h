// The element-wise parts of attention that are not matrix products: masked
// safe softmax, LayerNorm with residual, bf16 conversion. Plain functions on
// raw buffers; vectorised for the machine at run time (AVX-512/AVX2/base).
#ifndef MHA_ENGINE_KERNELS_H_
#define MHA_ENGINE_KERNELS_H_

#include <cstdint>

namespace mha {

// Masks applied to one block of score rows, [heads, rows, cols] row-major.
// Additive masks apply to the first `masked_cols` columns only (positions
// appended by bias_kv / zero_attn are never masked, as in PyTorch).
struct SoftmaxMasks {
  const float* key_padding = nullptr;  // [masked_cols], added to every row
  const float* attn = nullptr;         // [rows, masked_cols] (+ head stride)
  int64_t attn_head_stride = 0;        // 0: shared by all heads
  int64_t attn_row_stride = 0;
  bool causal = false;
  int64_t first_row = 0;  // row index of the block's first row (for causal)
  int64_t masked_cols = 0;
};

// In place: scores -> probabilities, row by row, after adding the masks. A
// row whose every column is -inf (all keys masked) becomes all zeros instead
// of NaN. Parallel over rows with OpenMP when the block is large.
void MaskedSoftmax(float* scores, int64_t heads, int64_t rows, int64_t cols,
                   const SoftmaxMasks& masks);

// out[t] = LayerNorm(out[t] + residual[t]) * gamma + beta, per row of width n.
void AddLayerNorm(float* out, const float* residual, const float* gamma,
                  const float* beta, int64_t rows, int64_t n, float eps);

// f32 -> bf16 (round to nearest even), and its inverse.
void ConvertToBf16(const float* in, uint16_t* out, int64_t count);
void ConvertBf16ToF32(const uint16_t* in, float* out, int64_t count);

// Copies `rows` rows of `width` elements between strided buffers.
void CopyRows(const void* src, int64_t src_stride_bytes, void* dst,
              int64_t dst_stride_bytes, int64_t rows, int64_t row_bytes);

// weights[r, c] = mean over heads of probs[h, r, c].
void AverageHeads(const float* probs, int64_t heads, int64_t rows, int64_t cols,
                  float* weights);

}  // namespace mha

#endif  // MHA_ENGINE_KERNELS_H_
