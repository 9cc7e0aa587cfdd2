// The parts of attention that are not oneDNN matrix products: masked safe
// softmax and LayerNorm with residual (softmax_kernels.cc), bf16 rows and the
// heads' layout (layout_kernels.cc), the small path's scores and context
// (small_block_kernels.cc), the session steps' block loops
// (block_kernels.cc, int8_kernels.cc), the int8 projections' conversions
// (int8_projection_kernels.cc). Plain functions on raw buffers;
// vectorised for the machine at run time (AVX-512/AVX2/base).
#ifndef MHA_ENGINE_OPS_KERNELS_H_
#define MHA_ENGINE_OPS_KERNELS_H_

#include <algorithm>
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

// Whether causal masking hides columns [col0, col0 + cols) from every one of
// rows [row0, row0 + rows) of the block `m` describes (columns appended after
// the masked ones are never hidden): a key tile those rows may skip.
inline bool CausalMaskHides(const SoftmaxMasks& m, int64_t row0, int64_t rows, int64_t col0,
                            int64_t cols) {
  return m.causal && col0 + cols <= m.masked_cols && col0 > m.first_row + row0 + rows - 1;
}

// Scores -> probabilities, row by row, after adding the masks. A row whose
// every column is -inf (all keys masked) becomes all zeros instead of NaN.
// Probabilities are written in place (f32) and, when `bf16_out` is not null,
// also as bf16 there (same layout) for a bf16 product that follows. With
// `bf16_out` and `f32_probs` false they go to `bf16_out` only (`scores` is
// then scratch), from a cheaper exp accurate to ~4e-6 relative: what a bf16
// product needs and nothing more.
// Parallel over rows with OpenMP when the block is large.
void MaskedSoftmax(float* scores, int64_t heads, int64_t rows, int64_t cols,
                   const SoftmaxMasks& masks, uint16_t* bf16_out = nullptr, bool f32_probs = true);

// One key tile of an online (flash-attention style) softmax: `scores`
// [rows, cols] are the scaled scores of columns [col0, col0 + cols) of each
// row (masks indexed as in MaskedSoftmax, by the full row). Per row, given
// the running maximum and sum of the tiles before, writes the tile's
// unnormalised probabilities exp(score - new max) in place or, when
// `bf16_out` is not null, as bf16 there only (from the cheaper exp of
// MaskedSoftmax's bf16-only mode; `scores` is then scratch), updates the
// running maximum and sum, and sets
// `rescale` to the factor that earlier accumulations must be multiplied by.
// A row with every key so far masked keeps sum 0; a row whose scores
// overflowed (+inf or NaN) gets sum NaN, so its output is NaN, as in
// MaskedSoftmax. Start a row with max -inf and sum 0.
struct OnlineSoftmaxRows {
  float* max = nullptr;      // [rows]
  float* sum = nullptr;      // [rows]
  float* rescale = nullptr;  // [rows]
};
void OnlineSoftmaxTile(float* scores, int64_t rows, int64_t cols, int64_t col0,
                       const SoftmaxMasks& masks, const OnlineSoftmaxRows& state,
                       uint16_t* bf16_out = nullptr);

// acc[r] = acc[r] * rescale[r] + product[r] for rows [rows, n].
void RescaleAccumulate(float* acc, const float* product, const float* rescale, int64_t rows,
                       int64_t n);

// out[r] = acc[r] / sum[r] (zeros where sum is 0: every key masked), as f32
// or, when `bf16`, as bf16.
void NormalizeRows(const float* acc, const float* sum, int64_t rows, int64_t n, bool bf16,
                   void* out);

// out[t] = LayerNorm(out[t] + residual[t]) * gamma + beta, per row of width n.
void AddLayerNorm(float* out, const float* residual, const float* gamma, const float* beta,
                  int64_t rows, int64_t n, float eps);

// f32 -> bf16 (round to nearest even; on both threads when large).
void ConvertToBf16(const float* in, uint16_t* out, int64_t count);

// Token-major rows [rows, heads * head] (row stride `src_row_bytes`) to
// head-major blocks: rows are cut into blocks of `block_rows`, each block
// stored as [heads, rows in block, head], blocks back to back. The layout
// spans `layout_rows` >= `rows` rows (room for appended rows). With
// block_rows >= layout_rows this is plain [heads, layout_rows, head].
// Copies are memory-bound; two threads help only on large ones.
inline constexpr int64_t kParallelCopyBytes = 256 << 10;

struct HeadLayout {
  int64_t heads = 1, head_bytes = 0;
  int64_t layout_rows = 0, block_rows = 1;
  // Byte offset of (head, row) in the layout.
  int64_t Offset(int64_t head, int64_t row) const {
    const int64_t block = row / block_rows, first = block * block_rows;
    const int64_t in_block = std::min(block_rows, layout_rows - first);
    return ((first * heads) + head * in_block + (row - first)) * head_bytes;
  }
};
void SplitHeads(const uint8_t* src, int64_t src_row_bytes, int64_t rows, const HeadLayout& layout,
                uint8_t* dst);
void MergeHeads(const uint8_t* src, const HeadLayout& layout, int64_t rows, uint8_t* dst,
                int64_t dst_row_bytes);

// Small attention products in plain vectorised loops, for blocks so small
// that a oneDNN call costs more than the arithmetic. All f32, contiguous:
// q [batch, rows, d], k [batch, cols, d] -> scores [batch, rows, cols] =
// scale * q k^T; probs [batch, rows, cols], v [batch, cols, dv] ->
// context [batch, rows, dv].
void SmallScores(const float* q, const float* k, float* scores, int64_t batch, int64_t rows,
                 int64_t cols, int64_t d, float scale);
void SmallContext(const float* probs, const float* v, float* context, int64_t batch, int64_t rows,
                  int64_t cols, int64_t dv);
// The same with bf16 q, k, v and context (f32 arithmetic).
void SmallScoresBf16(const uint16_t* q, const uint16_t* k, float* scores, int64_t batch,
                     int64_t rows, int64_t cols, int64_t d, float scale);
void SmallContextBf16(const float* probs, const uint16_t* v, uint16_t* context, int64_t batch,
                      int64_t rows, int64_t cols, int64_t dv);

// The step loops of session caches. Each reads one block of one head and
// takes `next`: where the block read after it keeps the same data (null:
// none). As they read a line of this block they fetch that line of the next
// one, so a step streams its blocks (which lie apart in memory, where the
// hardware prefetcher would start afresh at each one).
//
// The scores of one query row against one cache block's keys, stored
// transposed (kt [d, KvLayout::kBlockTokens], the token index fastest):
// out[j] = scale * q . key_j for the block's first n (<= 32) tokens. Every
// token slot is read (the others may hold anything); only n are written.
void BlockScores(const float* q, const float* kt, float* out, int64_t n, int64_t d, float scale,
                 const void* next = nullptr);
void BlockScoresBf16(const uint16_t* q, const uint16_t* kt, float* out, int64_t n, int64_t d,
                     float scale, const void* next = nullptr);
// An fp32 query against a bf16 cache's keys.
void BlockScoresF32Bf16(const float* q, const uint16_t* kt, float* out, int64_t n, int64_t d,
                        float scale, const void* next = nullptr);

// Int8 caches (kv_cache_dtype INT8). One key or value row as it is
// written: out[c * stride] = round(in[c] / scale) for c < n, where scale =
// max |in[c]| / 127 is returned; an all-zero row gets scale 0 (its elements
// 0), a row holding inf or NaN scale NaN (so what reads it is NaN, as the
// input was).
float QuantizeInt8(const float* in, int64_t n, int8_t* out, int64_t stride);
// The scores of an int8 block (as BlockScores): out[j] = scale *
// key_scales[j] * (q . kt[:, j]), for an f32 or a bf16 query.
void BlockScoresF32Int8(const float* q, const int8_t* kt, const float* key_scales, float* out,
                        int64_t n, int64_t d, float scale, const void* next = nullptr);
void BlockScoresBf16Int8(const uint16_t* q, const int8_t* kt, const float* key_scales, float* out,
                         int64_t n, int64_t d, float scale, const void* next = nullptr);

// acc[c] += sum over j < cols of probs[j] * v[j, c]: one query row's
// context over one block's values (v [cols, dv], f32, bf16 or int8).
void AccumulateContext(const float* probs, const float* v, float* acc, int64_t cols, int64_t dv,
                       const void* next = nullptr);
// Int8 values: the caller folds each row's value scale into its probability.
void AccumulateContextInt8(const float* probs, const int8_t* v, float* acc, int64_t cols,
                           int64_t dv, const void* next = nullptr);
void AccumulateContextBf16(const float* probs, const uint16_t* v, float* acc, int64_t cols,
                           int64_t dv, const void* next = nullptr);
// AccumulateContextBf16 keeps each 64 columns' sums split, even columns
// then odd ones (32 + 32); this puts them back in order, once, after the
// last block.
void MergeSplitContext(float* acc, int64_t dv);

// Int8 projections (LinearLayer's kInt8, engine/ops/int8_projection_kernels.cc).
// Rows [rows, k] of f32, or bf16 when `bf16`, to u8: out[r, c] =
// round(x[r, c] / scales[r]) + 128 (to nearest even), scales[r] = max
// |x[r, :]| / 127. An all-zero row gets scale 0 (its values 128), a row
// holding inf or NaN scale NaN (so its outputs are NaN, as the input was).
void QuantizeRowsU8(const void* x, bool bf16, int64_t rows, int64_t k, uint8_t* out, float* scales);
// The int8 product's s32 sums [rows, n] back to real numbers: y[r, c] =
// (sums[r, c] - offset_share[c]) * row_scales[r] * col_scales[c] + bias[c],
// as f32 or, when `bf16`, bf16. `sums` is overwritten (used as scratch).
struct Int8Dequantization {
  const float* row_scales = nullptr;      // [rows]
  const float* col_scales = nullptr;      // [n]
  const int32_t* offset_share = nullptr;  // [n]
  const float* bias = nullptr;            // [n]
};
void DequantizeRows(int32_t* sums, int64_t rows, int64_t n, const Int8Dequantization& d, bool bf16,
                    void* y);

// weights[r, c] (+)= sum over `heads` of probs[h, r, c] / total_heads:
// the mean over all heads when they come in several chunks (`first`
// overwrites, later chunks add).
void AccumulateHeadMean(const float* probs, int64_t heads, int64_t total_heads, int64_t rows,
                        int64_t cols, bool first, float* weights);

}  // namespace mha

#endif  // MHA_ENGINE_OPS_KERNELS_H_
