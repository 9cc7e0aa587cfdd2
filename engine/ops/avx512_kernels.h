// Hot loops of the softmax in AVX-512 intrinsics, for CPUs that have it
// (HasAvx512): the exp-and-sum of a row (the portable loop's exponent
// assembly and range checks cost as much as its polynomial, and it runs one
// dependency chain), written as f32 or straight to bf16, and
// f32 -> bf16 rounding (GCC vectorises the portable one at half width with
// a pack and a permute; with AVX512-BF16 it is one instruction).
#ifndef MHA_ENGINE_OPS_AVX512_KERNELS_H_
#define MHA_ENGINE_OPS_AVX512_KERNELS_H_

#include <cstdint>

namespace mha {

// What the kernels use: portable loops, AVX2 (with FMA; the int8 cache's
// step loops), AVX-512, or AVX-512 with its bf16 conversion. Ordered: each
// level has what the one before has.
enum class KernelIsa { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

// The best level this CPU has (checked once), at most the test cap.
KernelIsa ActiveKernelIsa();

// "portable", "avx2", "avx512", "avx512_bf16".
const char* KernelIsaName(KernelIsa isa);

// Tests: run the kernels at most at `cap`, to cover every path on one CPU.
void CapKernelIsaForTesting(KernelIsa cap);

// Whether the functions below may run: ActiveKernelIsa() >= kAvx512.
bool HasAvx512();

// row[j] = exp(row[j] - max) for j < cols, returning their sum: exact 0 for
// -inf and arguments below -1000 (denormals from -87 down, where the portable
// loop gives 0), NaN for NaN, ~4e-6 relative otherwise (the degree-4
// polynomial of the portable bf16 softmax). `max` is the row's
// finite maximum, so every argument is <= 0. Only when HasAvx512().
float ExpSumAvx512(float* row, int64_t cols, float max);

// The same with the ~2 ulp exp of f32 probabilities (the portable f32
// softmax's degree-6 polynomial).
float ExpSumAccurateAvx512(float* row, int64_t cols, float max);

// The same exp and sum, but the values go to out[j] as bf16 (rounded as
// ScaleToBf16Avx512) and the row is left as it was.
float ExpSumToBf16Avx512(const float* row, int64_t cols, float max, uint16_t* out);

// The two exp-and-sums above in AVX2 (engine/ops/avx2_kernels.cc), to 0
// below -87 as the portable loop (no denormals). Only when
// ActiveKernelIsa() >= kAvx2.
float ExpSumAvx2(float* row, int64_t cols, float max);
float ExpSumAccurateAvx2(float* row, int64_t cols, float max);

// out[i] = bf16(in[i] * scale), rounded to nearest even, for i < count
// (with kAvx512Bf16, denormal results become 0).
void ScaleToBf16Avx512(const float* in, float scale, uint16_t* out, int64_t count);

// One row of DequantizeRows (kernels.h): out[c] = (sums[c] -
// offset_share[c]) * row_scale * col_scales[c] + bias[c] for c < n, as f32
// or, when `bf16`, bf16 (rounded as ScaleToBf16Avx512).
void DequantizeRowAvx512(const int32_t* sums, int64_t n, float row_scale, const float* col_scales,
                         const int32_t* offset_share, const float* bias, bool bf16, void* out);

// Rows of MaskedSoftmax (kernels.h) of at most kShortSoftmaxCols scores,
// up to kShortSoftmaxRows at a time, in registers: the same masks, exps,
// sums and outputs (bf16_only: each row keeps its unnormalised exps from
// the cheap exp, its `bf16` gets the probabilities), with no pass over
// memory between the steps. `add_a` and `masked` are shared by the rows.
inline constexpr int64_t kShortSoftmaxCols = 64;
inline constexpr int kShortSoftmaxRows = 4;
struct ShortSoftmaxRow {
  float* scores = nullptr;       // [cols], in place
  const float* add_b = nullptr;  // the row's own additive mask, or null
  int64_t causal_limit = 0;      // -inf from here to `masked`
  uint16_t* bf16 = nullptr;      // [cols], or null
};
void SoftmaxShortRowsAvx512(const ShortSoftmaxRow* rows, int n, int64_t cols, const float* add_a,
                            int64_t masked, bool bf16_only);

// BlockScoresBf16 (kernels.h) with AVX512-BF16's pair dot product
// (engine/ops/bf16_dot_kernels.cc): the same sums to f32 rounding
// (denormal keys and query elements count as 0). Only when
// ActiveKernelIsa() == kAvx512Bf16.
void BlockScoresBf16Dot(const uint16_t* q, const uint16_t* kt, float* out, int64_t n, int64_t d,
                        float scale, const void* next);
// AccumulateContextBf16 the same way, the probabilities rounded to bf16.
void AccumulateContextBf16Dot(const float* probs, const uint16_t* v, float* acc, int64_t cols,
                              int64_t dv, const void* next);

// SmallScoresBf16 and SmallContextBf16 (kernels.h) with the pair dot
// product: a head's keys 16 at a time as pairs (heads of an even depth up
// to kSmallDotMaxDepth), its values two keys at a time, the probabilities
// rounded to bf16 (as the larger blocks' products take them). Only when
// ActiveKernelIsa() == kAvx512Bf16.
inline constexpr int64_t kSmallDotMaxDepth = 256;
void SmallScoresBf16Dot(const uint16_t* q, const uint16_t* k, float* scores, int64_t batch,
                        int64_t rows, int64_t cols, int64_t d, float scale);
void SmallContextBf16Dot(const float* probs, const uint16_t* v, uint16_t* context, int64_t batch,
                         int64_t rows, int64_t cols, int64_t dv);

}  // namespace mha

#endif  // MHA_ENGINE_OPS_AVX512_KERNELS_H_
