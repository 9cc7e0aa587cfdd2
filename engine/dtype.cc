#include "engine/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace mha {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kBool:
      return 1;
  }
  return 0;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) {
    return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0));
  }
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow: inf
  if (exponent <= 0) {                                               // subnormal or zero
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exponent
  return static_cast<uint16_t>(sign | half);
}

void ConvertToFloat(DType dtype, const uint8_t* bytes, int64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(out, bytes, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, bytes + 2 * i, 2);
        out[i] = dtype == DType::kF16 ? HalfToFloat(v) : Bf16ToFloat(v);
      }
      return;
    case DType::kBool:
      for (int64_t i = 0; i < n; ++i) out[i] = bytes[i] != 0 ? 1.0f : 0.0f;
      return;
  }
}

void ConvertFromFloat(const float* values, int64_t n, DType dtype, uint8_t* bytes) {
  if (dtype == DType::kF32) {
    if (n > 0) std::memcpy(bytes, values, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(values[i]) : FloatToHalf(values[i]);
    std::memcpy(bytes + 2 * i, &h, 2);
  }
}

}  // namespace mha
