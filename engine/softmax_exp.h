// The exp-and-sum step of a softmax row whose probabilities feed a bf16
// product only, in AVX-512 intrinsics where the CPU has them: the portable
// loop's exponent assembly and range checks cost as much as its polynomial.
#ifndef MHA_ENGINE_SOFTMAX_EXP_H_
#define MHA_ENGINE_SOFTMAX_EXP_H_

#include <cstdint>

namespace mha {

// Whether ExpSumAvx512 may run on this CPU (checked once).
bool HasAvx512();

// row[j] = exp(row[j] - max) for j < cols, returning their sum: exact 0 for
// -inf and arguments below -87, NaN for NaN, ~4e-6 relative otherwise (the
// degree-4 polynomial of the portable bf16 softmax). `max` is the row's
// finite maximum, so every argument is <= 0. Only when HasAvx512().
float ExpSumAvx512(float* row, int64_t cols, float max);

}  // namespace mha

#endif  // MHA_ENGINE_SOFTMAX_EXP_H_
