// f32 rows to bf16, as the kernels write them: the one vector converter
// beside dtype.h's scalar pair (FloatToBf16, Bf16ToFloat), which every
// scalar conversion in the kernels uses.
#ifndef MHA_ENGINE_OPS_BF16_ROWS_H_
#define MHA_ENGINE_OPS_BF16_ROWS_H_

#include <cstdint>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"

namespace mha {

// out[i] = bf16(in[i] * scale), rounded to nearest even, NaN kept: in
// AVX-512 intrinsics where the CPU has them, else dtype.h's FloatToBf16 in
// a loop the compiler vectorises. Inlined into each multiversioned caller.
inline void ScaleToBf16(const float* in, float scale, uint16_t* out, int64_t count) {
  if (HasAvx512()) return ScaleToBf16Avx512(in, scale, out, count);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) out[i] = FloatToBf16(in[i] * scale);
}

}  // namespace mha

#endif  // MHA_ENGINE_OPS_BF16_ROWS_H_
