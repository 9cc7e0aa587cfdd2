// Element types and the one home of their conversions to and from f32: what
// the compute path needs of dtypes. Their names in each format's spelling
// are engine/tensor.h's, outside the compute path.
#ifndef MHA_ENGINE_DTYPE_H_
#define MHA_ENGINE_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace mha {

enum class DType { kF32, kF16, kBF16, kBool };

// Bytes per element of `dtype` (bool: one byte).
size_t DTypeSize(DType dtype);

float HalfToFloat(uint16_t h);
float Bf16ToFloat(uint16_t b);
// Round-to-nearest-even, NaN preserved.
uint16_t FloatToBf16(float f);
uint16_t FloatToHalf(float f);
// `n` elements of `dtype` at `bytes` (little-endian, any alignment) as f32
// (BOOL: 0/1).
void ConvertToFloat(DType dtype, const uint8_t* bytes, int64_t n, float* out);
// `n` f32 values as `dtype` (F32, F16 or BF16) at `bytes`.
void ConvertFromFloat(const float* values, int64_t n, DType dtype, uint8_t* bytes);

}  // namespace mha

#endif  // MHA_ENGINE_DTYPE_H_
