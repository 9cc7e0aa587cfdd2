// Int8 linear layers (LinearPrecision::kInt8) against the same quantized
// product computed in doubles here, their conversions at every instruction
// level this CPU has, and their column ranges against their own packs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/kernels.h"
#include "engine/ops/linear_layer.h"
#include "engine/threads.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using onednn::dt;
using testing::RandomVector;

// A row's symmetric int8 values and scale, as the layer is documented to
// round (max |v| / 127, to nearest even).
struct QuantizedRow {
  std::vector<double> values;
  double scale = 0;
};
QuantizedRow Quantize(const float* row, int64_t n) {
  float max = 0;
  for (int64_t i = 0; i < n; ++i) max = std::max(max, std::fabs(row[i]));
  QuantizedRow q;
  q.scale = max / 127.0f;
  const float inverse = max > 0 ? 127.0f / max : 0.0f;
  for (int64_t i = 0; i < n; ++i) q.values.push_back(std::nearbyint(row[i] * inverse));
  return q;
}

// y = quantized(x) . quantized(W)^T * scales + b, in doubles.
std::vector<double> QuantizedProduct(const std::vector<float>& x, const std::vector<float>& w,
                                     const std::vector<float>& b, int64_t m, int64_t n, int64_t k) {
  std::vector<QuantizedRow> wq;
  for (int64_t j = 0; j < n; ++j) wq.push_back(Quantize(w.data() + j * k, k));
  std::vector<double> y(m * n);
  for (int64_t r = 0; r < m; ++r) {
    const QuantizedRow xq = Quantize(x.data() + r * k, k);
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t c = 0; c < k; ++c) sum += xq.values[c] * wq[j].values[c];
      y[r * n + j] = sum * xq.scale * wq[j].scale + b[j];
    }
  }
  return y;
}

// Runs `layer` on f32 `x` (converted to bf16 for a bf16 layer) and returns
// f32 outputs.
std::vector<float> RunInt8Layer(const LinearLayer& layer, dt type, const std::vector<float>& x,
                                int64_t m, int64_t n) {
  Workspace ws(onednn::CpuEngine());
  std::vector<float> y(m * n);
  if (type == dt::f32) {
    layer.Run(ws, x.data(), m, y.data());
    return y;
  }
  std::vector<uint16_t> xb(x.size()), yb(y.size());
  ConvertToBf16(x.data(), xb.data(), static_cast<int64_t>(x.size()));
  layer.Run(ws, xb.data(), m, yb.data());
  for (size_t i = 0; i < yb.size(); ++i) y[i] = Bf16ToFloat(yb[i]);
  return y;
}

// Bf16 inputs as the layer sees them (rounded), for the reference.
std::vector<float> AsLayerSees(const std::vector<float>& x, dt type) {
  if (type == dt::f32) return x;
  std::vector<float> rounded(x.size());
  for (size_t i = 0; i < x.size(); ++i) rounded[i] = Bf16ToFloat(FloatToBf16(x[i]));
  return rounded;
}

std::vector<dt> Types() {
  std::vector<dt> types = {dt::f32};
  if (CpuCanComputeBf16()) types.push_back(dt::bf16);
  return types;
}

// Only where int8 dot products exist does the engine use int8 layers, so
// their arithmetic is checked there; elsewhere the engine's fallback is.
TEST(Int8LinearTest, EqualsTheQuantizedProductInDoubles) {
  if (!CpuHasInt8Dot()) {
    AttentionDims d = testing::MakeDims(24, 3);
    d.int8 = true;
    EXPECT_FALSE(MhaEngine::Create(d, testing::RandomWeights(d, 1)).value()->dims().int8);
    return;
  }
  for (const dt type : Types()) {
    // Odd widths, a whole-block one, and rows beyond one 512-row chunk.
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{40, 24}, {96, 256}, {3 * 64, 64}}) {
      const std::vector<float> w = RandomVector(n * k, 3, 0.2f);
      std::vector<float> b = RandomVector(n, 4);
      const LinearLayer layer(onednn::CpuEngine(), w, b, n, k, type, type, LinearPrecision::kInt8);
      EXPECT_TRUE(layer.int8());
      for (const int64_t m : {int64_t{1}, int64_t{7}, int64_t{300}, int64_t{1100}}) {
        SCOPED_TRACE(::testing::Message() << "type " << static_cast<int>(type) << " n " << n
                                          << " k " << k << " m " << m);
        std::vector<float> x = RandomVector(m * k, 5 + m, 2.0f);
        for (int64_t c = 0; c < k; ++c) x[c] = 0.0f;  // an all-zero row: its bias
        const std::vector<float> got = RunInt8Layer(layer, type, x, m, n);
        const std::vector<double> want = QuantizedProduct(AsLayerSees(x, type), w, b, m, n, k);
        // f32 dequantization of exact s32 sums (bf16 outputs: their rounding).
        const double tolerance = type == dt::f32 ? 2e-6 : 8e-3;
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(1.0, std::fabs(want[i])));
        }
        EXPECT_LE(worst, tolerance);
        for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(got[j], b[j], type == dt::f32 ? 0 : 4e-3);
      }
    }
  }
}

TEST(Int8LinearTest, ColumnRangesAgreeWithTheirOwnPacks) {
  constexpr int64_t e = 256, n = 3 * e;
  const std::vector<float> w = RandomVector(n * e, 8), b = RandomVector(n, 9);
  const LinearLayer fused(onednn::CpuEngine(), w, b, n, e, dt::f32, dt::f32,
                          LinearPrecision::kInt8);
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{0, e}, {e, 2 * e}, {2 * e, e}}) {
    const std::unique_ptr<LinearLayer> part = LinearLayer::ColumnsOf(fused, first, count);
    const std::vector<float> rows(w.begin() + first * e, w.begin() + (first + count) * e);
    const std::vector<float> bias(b.begin() + first, b.begin() + first + count);
    const LinearLayer own(onednn::CpuEngine(), rows, bias, count, e, dt::f32, dt::f32,
                          LinearPrecision::kInt8);
    const std::vector<float> x = RandomVector(70 * e, 10);
    if (part != nullptr) {
      EXPECT_EQ(RunInt8Layer(*part, dt::f32, x, 70, count),
                RunInt8Layer(own, dt::f32, x, 70, count))
          << first;
      EXPECT_EQ(part->bytes(), 0);
    }
    // The stacked layer's columns are the same numbers.
    const std::vector<float> all = RunInt8Layer(fused, dt::f32, x, 70, n);
    const std::vector<float> alone = RunInt8Layer(own, dt::f32, x, 70, count);
    for (int64_t r = 0; r < 70; ++r) {
      for (int64_t j = 0; j < count; ++j) ASSERT_EQ(all[r * n + first + j], alone[r * count + j]);
    }
  }
}

// From 128 rows per thread on, each thread takes its own rows through
// quantization, product and dequantization in its child workspace: the
// same bits as one thread's run, rows split at any point (odd counts too).
TEST(Int8LinearTest, RowsSharedOutThreadByThreadGiveTheSameBits) {
  constexpr int64_t n = 3 * 64, k = 64;
  const std::vector<float> w = RandomVector(n * k, 11, 0.2f), b = RandomVector(n, 12);
  const LinearLayer layer(onednn::CpuEngine(), w, b, n, k, dt::f32, dt::f32,
                          LinearPrecision::kInt8);
  EXPECT_EQ(layer.Int8ThreadRows(255, 2), 0);
  EXPECT_EQ(layer.Int8ThreadRows(257, 2), 129);
  EXPECT_EQ(layer.Int8ThreadRows(1000, 1), 0);
  const int before = ComputeThreads();
  for (const int64_t m : {int64_t{200}, int64_t{256}, int64_t{1337}}) {
    SCOPED_TRACE(m);
    const std::vector<float> x = RandomVector(m * k, 13, 2.0f);
    std::vector<float> alone(m * n), shared(m * n);
    SetComputeThreads(1);
    Workspace one(onednn::CpuEngine());
    layer.Run(one, x.data(), m, alone.data());
    SetComputeThreads(2);  // one under TSan (see SetComputeThreads): no sharing then
    const bool team = ComputeThreads() == 2;
    Workspace two(onednn::CpuEngine());
    layer.Run(two, x.data(), m, shared.data());
    EXPECT_EQ(shared, alone);
    EXPECT_EQ(one.num_children(), 0);
    // Below 2 x 128 rows the team shares each step instead, on `two` itself.
    EXPECT_EQ(two.num_children(), team && m >= 256 ? 2 : 0);
    if (team && m >= 256) {
      EXPECT_GT(two.Child(1).bytes_held(), 0u);
    }
  }
  SetComputeThreads(before);
}

class Int8KernelTest : public ::testing::TestWithParam<KernelIsa> {
 protected:
  void SetUp() override { CapKernelIsaForTesting(GetParam()); }
  void TearDown() override { CapKernelIsaForTesting(KernelIsa::kAvx512Bf16); }
};

// Rows to u8 at this level equal the portable loop's (scales and values),
// from f32 and bf16, with an all-zero row (scale 0, values 128) and rows
// holding inf or NaN (scale NaN, values 128: what they multiply is NaN).
TEST_P(Int8KernelTest, QuantizedRowsEqualThePortableOnes) {
  constexpr int64_t rows = 5, k = 37;
  std::vector<float> x = RandomVector(rows * k, 12, 3.0f);
  std::fill(x.begin() + k, x.begin() + 2 * k, 0.0f);
  x[2 * k + 5] = std::numeric_limits<float>::infinity();
  x[3 * k + 36] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = FloatToBf16(x[i]);
  for (const bool bf16 : {false, true}) {
    const void* in = bf16 ? static_cast<const void*>(xb.data()) : x.data();
    std::vector<uint8_t> got(rows * k), want(rows * k);
    std::vector<float> got_scales(rows), want_scales(rows);
    QuantizeRowsU8(in, bf16, rows, k, got.data(), got_scales.data());
    CapKernelIsaForTesting(KernelIsa::kPortable);
    QuantizeRowsU8(in, bf16, rows, k, want.data(), want_scales.data());
    CapKernelIsaForTesting(GetParam());
    for (const int64_t r : {0, 4}) {
      EXPECT_EQ(got_scales[r], want_scales[r]) << r;
      for (int64_t c = 0; c < k; ++c) {
        const float v = bf16 ? Bf16ToFloat(xb[r * k + c]) : x[r * k + c];
        ASSERT_EQ(got[r * k + c], want[r * k + c]) << r << " " << c;
        ASSERT_NEAR(got[r * k + c] - 128.0, v / got_scales[r], 0.5 + 1e-4);
      }
    }
    EXPECT_EQ(got_scales[1], 0.0f);
    EXPECT_TRUE(
        std::all_of(got.begin() + k, got.begin() + 2 * k, [](uint8_t v) { return v == 128; }));
    EXPECT_TRUE(std::isnan(got_scales[2]));
    EXPECT_TRUE(std::isnan(got_scales[3]));
    EXPECT_EQ(got, want);  // every row, the inf and NaN ones all 128 in both
    EXPECT_TRUE(
        std::all_of(got.begin() + 2 * k, got.begin() + 4 * k, [](uint8_t v) { return v == 128; }));
  }
}

// The s32 sums back to numbers: (sum - offset share) * row scale * column
// scale + bias, as f32 and as bf16.
TEST_P(Int8KernelTest, DequantizedRowsScaleAndAddTheBias) {
  constexpr int64_t rows = 3, n = 35;
  std::vector<int32_t> sums(rows * n), offsets(n);
  for (int64_t i = 0; i < rows * n; ++i) sums[i] = static_cast<int32_t>(i * 7919 % 20011) - 10000;
  for (int64_t j = 0; j < n; ++j) offsets[j] = static_cast<int32_t>(j * 128 - 2000);
  const std::vector<float> row_scales = {0.5f, 0.0f, 0.01f};
  const std::vector<float> col_scales = RandomVector(n, 14), bias = RandomVector(n, 15);
  const Int8Dequantization d{row_scales.data(), col_scales.data(), offsets.data(), bias.data()};
  for (const bool bf16 : {false, true}) {
    std::vector<int32_t> scratch = sums;
    std::vector<float> f32(rows * n);
    std::vector<uint16_t> b16(rows * n);
    DequantizeRows(scratch.data(), rows, n, d, bf16,
                   bf16 ? static_cast<void*>(b16.data()) : f32.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        const double want =
            static_cast<double>(sums[r * n + j] - offsets[j]) * row_scales[r] * col_scales[j] +
            bias[j];
        const double got = bf16 ? Bf16ToFloat(b16[r * n + j]) : f32[r * n + j];
        EXPECT_NEAR(got, want, (bf16 ? 4e-3 : 1e-6) * std::max(1.0, std::fabs(want)))
            << r << " " << j;
      }
    }
  }
}

std::vector<KernelIsa> Levels() {
  std::vector<KernelIsa> levels = {KernelIsa::kPortable};
  if (HasAvx512()) levels.push_back(KernelIsa::kAvx512);
  return levels;
}

INSTANTIATE_TEST_SUITE_P(Levels, Int8KernelTest, ::testing::ValuesIn(Levels()),
                         [](const auto& info) { return std::string(KernelIsaName(info.param)); });

}  // namespace
}  // namespace mha
