// Hot loops of the bf16 softmax in AVX-512 intrinsics, for CPUs that have
// it (HasAvx512): the exp-and-sum of a row whose probabilities feed a bf16
// product only (the portable loop's exponent assembly and range checks cost
// as much as its polynomial), and f32 -> bf16 rounding (GCC vectorises the
// portable one at half width with a pack and a permute).
#ifndef MHA_ENGINE_AVX512_KERNELS_H_
#define MHA_ENGINE_AVX512_KERNELS_H_

#include <cstdint>

namespace mha {

// Whether the functions below may run on this CPU (checked once).
bool HasAvx512();

// row[j] = exp(row[j] - max) for j < cols, returning their sum: exact 0 for
// -inf and arguments below -87, NaN for NaN, ~4e-6 relative otherwise (the
// degree-4 polynomial of the portable bf16 softmax). `max` is the row's
// finite maximum, so every argument is <= 0. Only when HasAvx512().
float ExpSumAvx512(float* row, int64_t cols, float max);

// out[i] = bf16(in[i] * scale), rounded to nearest even, for i < count.
void ScaleToBf16Avx512(const float* in, float scale, uint16_t* out, int64_t count);

}  // namespace mha

#endif  // MHA_ENGINE_AVX512_KERNELS_H_
