#include "engine/dtype.h"

#include <cpuid.h>
#include <immintrin.h>

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

namespace {

uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void Store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// F16 <-> f32 eight at a time with F16C (every x86-64 CPU with AVX has
// it; exact both ways for finite values, rounding to nearest even), the
// scalar conversions for the tail and for CPUs without it.
__attribute__((target("avx,f16c"))) void HalvesToFloats(const uint8_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(Load16(in + 2 * i));
}

__attribute__((target("avx,f16c"))) void FloatsToHalves(const float* in, int64_t n, uint8_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
  }
  for (; i < n; ++i) Store16(out + 2 * i, FloatToHalf(in[i]));
}

// F16C is bit 29 of CPUID 1's ECX (clang 14 has no "f16c" for
// __builtin_cpu_supports); "avx" also says the OS saves the YMM state.
bool HasF16c() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (ecx & (1u << 29)) != 0 && __builtin_cpu_supports("avx");
  }();
  return has;
}

}  // namespace

void ConvertToFloat(DType dtype, const uint8_t* bytes, int64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(out, bytes, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      if (HasF16c()) return HalvesToFloats(bytes, n, out);
      for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(Load16(bytes + 2 * i));
      return;
    case DType::kBF16:  // a shift: the compiler vectorizes the loop
      for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(Load16(bytes + 2 * i));
      return;
    case DType::kBool:
      for (int64_t i = 0; i < n; ++i) out[i] = bytes[i] != 0 ? 1.0f : 0.0f;
      return;
  }
}

void ConvertFromFloat(const float* values, int64_t n, DType dtype, uint8_t* bytes) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(bytes, values, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      if (HasF16c()) return FloatsToHalves(values, n, bytes);
      for (int64_t i = 0; i < n; ++i) Store16(bytes + 2 * i, FloatToHalf(values[i]));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) Store16(bytes + 2 * i, FloatToBf16(values[i]));
      return;
    case DType::kBool:
      return;  // not an output dtype
  }
}

}  // namespace mha
