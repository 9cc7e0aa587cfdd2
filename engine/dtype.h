// Element types and the one home of their conversions to and from f32: what
// the compute path needs of dtypes. Their names in each format's spelling
// are engine/tensor.h's, outside the compute path.
#ifndef MHA_ENGINE_DTYPE_H_
#define MHA_ENGINE_DTYPE_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mha {

enum class DType { kF32, kF16, kBF16, kBool };

// Bytes per element of `dtype` (bool: one byte).
size_t DTypeSize(DType dtype);

float HalfToFloat(uint16_t h);
// The bf16 pair inline: the step loops convert a cache row per token.
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
// Round-to-nearest-even, NaN preserved.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}
uint16_t FloatToHalf(float f);
// `n` elements of `dtype` at `bytes` (little-endian, any alignment) as f32
// (BOOL: 0/1).
void ConvertToFloat(DType dtype, const uint8_t* bytes, int64_t n, float* out);
// `n` f32 values as `dtype` (F32, F16 or BF16) at `bytes`.
void ConvertFromFloat(const float* values, int64_t n, DType dtype, uint8_t* bytes);

}  // namespace mha

#endif  // MHA_ENGINE_DTYPE_H_
