// engine/dtype.h's scalar conversions: f16 and bf16 to and from f32.
#include "engine/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace mha {
namespace {

TEST(HalfToFloatTest, NormalValues) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x3800), 0.5f);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);               // largest finite
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
}

TEST(HalfToFloatTest, SubnormalValues) {
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(HalfToFloat(0x8001), -std::ldexp(1.0f, -24));
}

TEST(HalfToFloatTest, SignedZeroInfinityAndNan) {
  EXPECT_EQ(HalfToFloat(0x0000), 0.0f);
  EXPECT_FALSE(std::signbit(HalfToFloat(0x0000)));
  EXPECT_EQ(HalfToFloat(0x8000), 0.0f);
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(HalfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
}

TEST(Bf16ToFloatTest, IsTheUpperHalfOfAFloat) {
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xC040), -3.0f);
  EXPECT_EQ(Bf16ToFloat(0x3F81), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(Bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // subnormal
  EXPECT_EQ(Bf16ToFloat(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7FC0)));
}

TEST(FloatToBf16Test, ExactValuesAreUnchanged) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-3.0f), 0xC040);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
}

TEST(FloatToBf16Test, RoundsToNearest) {
  // bf16 has 7 fraction bits: neighbours of 1 are 1 and 1 + 2^-7.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -9)), 0x3F80);   // below half
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(3.0f, -9)), 0x3F81);   // above half
  EXPECT_EQ(FloatToBf16(-1.0f - std::ldexp(3.0f, -9)), 0xBF81);  // symmetric
}

TEST(FloatToBf16Test, TiesRoundToEven) {
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // 0x3F80 even
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(3.0f, -8)), 0x3F82);  // 0x3F82 even
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            0x3F81);  // just above the tie
}

TEST(FloatToBf16Test, LargestFloatRoundsToInfinity) {
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
}

TEST(FloatToBf16Test, NanStaysNanEvenWithOnlyLowPayloadBits) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  // 0x7F800001 would truncate to infinity (0x7F80) without care.
  const uint32_t bits = 0x7F800001u;
  float low_nan;
  std::memcpy(&low_nan, &bits, 4);
  ASSERT_TRUE(std::isnan(low_nan));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(low_nan))));
}

// The array conversions (vectorized where the CPU allows) agree bit for
// bit with the scalar ones: every half value, and floats around every
// rounding edge (ties, subnormals, overflow), at lengths that leave tails.
TEST(ConvertArrayTest, HalvesMatchTheScalarConversionBothWays) {
  std::vector<uint16_t> halves;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    if (((h >> 10) & 0x1f) != 31) halves.push_back(static_cast<uint16_t>(h));  // not inf or NaN
  }
  std::vector<float> floats(halves.size() + 3);
  ConvertToFloat(DType::kF16, reinterpret_cast<const uint8_t*>(halves.data()),
                 static_cast<int64_t>(halves.size()), floats.data());
  for (size_t i = 0; i < halves.size(); ++i) {
    const float want = HalfToFloat(halves[i]);
    ASSERT_EQ(std::memcmp(&floats[i], &want, 4), 0) << halves[i];
  }
  std::vector<float> values = {
      65504.0f, 65520.0f,           65519.99f,          1e30f, -1e30f, 5.96e-8f, 2.98e-8f,
      2.99e-8f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, -0.0f, 0.0f};
  for (int i = 0; i < 5000; ++i) values.push_back(std::ldexp(1.0f + i * 1e-4f, i % 40 - 26));
  std::vector<uint16_t> vector_halves(values.size());
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), DType::kF16,
                   reinterpret_cast<uint8_t*>(vector_halves.data()));
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(vector_halves[i], FloatToHalf(values[i])) << values[i];
  }
  std::vector<uint16_t> bf16(values.size());
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), DType::kBF16,
                   reinterpret_cast<uint8_t*>(bf16.data()));
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(bf16[i], FloatToBf16(values[i]));
}

}  // namespace
}  // namespace mha
