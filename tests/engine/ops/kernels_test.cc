// The element-wise kernels on their own: the bf16-only softmax against the
// f32 one and a double-precision softmax, head split/merge against a plain
// copy, bf16 conversion on both threads against the element-wise rule, and
// the int8 cache's rounding and step loops against their scaled values, and
// the small path's scores and context against double-precision products.
// The bf16 kernels run at every instruction level this CPU has (portable,
// AVX-512, AVX512-BF16), so each code path is checked on the machine.
#include "engine/ops/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/ops/avx512_kernels.h"
#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha {
namespace {

using testing::RandomVector;

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Runs a test at one kernel level, then restores the CPU's best.
class KernelsIsaTest : public ::testing::TestWithParam<KernelIsa> {
 protected:
  void SetUp() override { CapKernelIsaForTesting(GetParam()); }
  void TearDown() override { CapKernelIsaForTesting(KernelIsa::kAvx512Bf16); }
};

// Every level up to the one this CPU has.
std::vector<KernelIsa> LevelsOfThisCpu() {
  std::vector<KernelIsa> levels;
  for (KernelIsa isa :
       {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512, KernelIsa::kAvx512Bf16}) {
    if (isa <= ActiveKernelIsa()) levels.push_back(isa);
  }
  return levels;
}

std::string LevelName(const ::testing::TestParamInfo<KernelIsa>& info) {
  return KernelIsaName(info.param);
}

INSTANTIATE_TEST_SUITE_P(Levels, KernelsIsaTest, ::testing::ValuesIn(LevelsOfThisCpu()), LevelName);

// Softmax of one row in double precision, masked positions (-inf) excluded.
std::vector<double> ExactSoftmax(const float* row, int64_t cols) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < cols; ++j) max = std::max(max, static_cast<double>(row[j]));
  std::vector<double> p(cols);
  double sum = 0.0;
  for (int64_t j = 0; j < cols; ++j) sum += p[j] = std::exp(row[j] - max);
  for (double& x : p) x /= sum;
  return p;
}

TEST_P(KernelsIsaTest, Bf16OnlySoftmaxMatchesExactWithinBf16Rounding) {
  const int64_t heads = 3, rows = 5, cols = 77;  // odd width: vector tails
  // Scores up to +-40: exp arguments down to -80, near the underflow clamp.
  std::vector<float> scores = RandomVector(heads * rows * cols, 7, 40.0f);
  std::vector<float> key_padding(cols, 0.0f);
  key_padding[3] = key_padding[50] = -std::numeric_limits<float>::infinity();
  SoftmaxMasks masks;
  masks.key_padding = key_padding.data();
  masks.masked_cols = cols;
  masks.causal = true;
  masks.first_row = 10;
  // The expected probabilities: masks applied by hand, then exact softmax.
  std::vector<float> masked = scores;
  for (int64_t hr = 0; hr < heads * rows; ++hr) {
    const int64_t r = hr % rows;
    for (int64_t j = 0; j < cols; ++j) {
      if (j > masks.first_row + r || key_padding[j] != 0.0f) {
        masked[hr * cols + j] = -std::numeric_limits<float>::infinity();
      }
    }
  }
  std::vector<uint16_t> bf16(scores.size());
  MaskedSoftmax(scores.data(), heads, rows, cols, masks, bf16.data(), /*f32_probs=*/false);
  for (int64_t hr = 0; hr < heads * rows; ++hr) {
    const std::vector<double> exact = ExactSoftmax(masked.data() + hr * cols, cols);
    for (int64_t j = 0; j < cols; ++j) {
      const double got = Bf16ToFloat(bf16[hr * cols + j]);
      // bf16 rounding is 2^-9 relative; the exp adds ~4e-6.
      EXPECT_NEAR(got, exact[j], exact[j] * 4.1e-3 + 1e-30) << "row " << hr << " col " << j;
      if (exact[j] == 0.0) {
        EXPECT_EQ(got, 0.0) << "masked position " << j;
      }
    }
  }
}

TEST_P(KernelsIsaTest, F32SoftmaxMatchesExactToAFewUlp) {
  // Untiled and key-tiled (two tiles, normalised at the end) against double
  // precision; 1e-6 relative is below the bf16 exp's own 3.2e-6, so this
  // also checks that f32 probabilities get the accurate exp.
  const int64_t rows = 6, cols = 150, half = cols / 2;
  // Scores within +-4: the f32 rounding of score - max then adds < 5e-7.
  const std::vector<float> scores = RandomVector(rows * cols, 13, 4.0f);
  SoftmaxMasks masks;
  masks.masked_cols = cols;
  std::vector<float> probs = scores;
  MaskedSoftmax(probs.data(), 1, rows, cols, masks, nullptr, /*f32_probs=*/true);
  std::vector<float> stats(3 * rows), tiled(rows * cols);
  const OnlineSoftmaxRows state{stats.data(), stats.data() + rows, stats.data() + 2 * rows};
  for (int64_t r = 0; r < rows; ++r) state.max[r] = -INFINITY, state.sum[r] = 0.0f;
  for (int64_t t = 0; t < 2; ++t) {
    std::vector<float> tile(rows * half);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(scores.begin() + r * cols + t * half, half, tile.begin() + r * half);
    }
    OnlineSoftmaxTile(tile.data(), rows, half, t * half, masks, state);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < t * half; ++j) tiled[r * cols + j] *= state.rescale[r];
      std::copy_n(tile.begin() + r * half, half, tiled.begin() + r * cols + t * half);
    }
  }
  double worst = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> exact = ExactSoftmax(scores.data() + r * cols, cols);
    for (int64_t j = 0; j < cols; ++j) {
      if (exact[j] < 1e-30) continue;  // relative error of denormals is not the point
      const double untiled_err = std::fabs(probs[r * cols + j] - exact[j]) / exact[j];
      const double tiled_err = std::fabs(tiled[r * cols + j] / state.sum[r] - exact[j]) / exact[j];
      worst = std::max({worst, untiled_err, tiled_err});
    }
  }
  EXPECT_LT(worst, 1e-6);
}

TEST_P(KernelsIsaTest, Bf16OnlySoftmaxKeepsFullyMaskedRowsZeroAndOverflowNaN) {
  const int64_t cols = 40;
  std::vector<float> scores = RandomVector(3 * cols, 11, 3.0f);
  std::vector<float> attn(3 * cols, 0.0f);
  for (int64_t j = 0; j < cols; ++j) attn[j] = -std::numeric_limits<float>::infinity();
  scores[2 * cols + 5] = std::numeric_limits<float>::infinity();  // row 2 overflowed
  SoftmaxMasks masks;
  masks.attn = attn.data();
  masks.attn_row_stride = cols;
  masks.masked_cols = cols;
  std::vector<uint16_t> bf16(scores.size(), 0x1234);
  MaskedSoftmax(scores.data(), 1, 3, cols, masks, bf16.data(), /*f32_probs=*/false);
  double row1_sum = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    EXPECT_EQ(bf16[j], 0) << "fully masked row, column " << j;
    row1_sum += Bf16ToFloat(bf16[cols + j]);
    EXPECT_TRUE(std::isnan(Bf16ToFloat(bf16[2 * cols + j]))) << "overflowed row, column " << j;
  }
  EXPECT_NEAR(row1_sum, 1.0, 1e-2);
}

// Rows of up to 64 scores (softmaxed in registers, four rows at a time, on
// AVX-512) against double precision at every width around the vector
// sizes, with every mask at once: key padding, a per-row mask with a head
// stride, causal rows; and a fully masked row (zeros) and an overflowed one
// (NaN), in the f32 (with its bf16 copy) and bf16-only modes.
TEST_P(KernelsIsaTest, ShortRowSoftmaxMatchesExactWithEveryMask) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t heads = 3, rows = 5;  // 15 rows: groups of four and a tail
  for (int64_t cols : {1, 7, 16, 17, 22, 32, 33, 48, 63, 64, 65}) {
    const std::vector<float> scores = RandomVector(heads * rows * cols, 21, 4.0f);
    std::vector<float> key_padding(cols, 0.0f), attn = RandomVector(heads * rows * cols, 22);
    if (cols > 1) key_padding[cols / 2] = -kInf;  // never key 0: each row keeps one
    for (int64_t j = 0; j < cols; ++j) attn[(1 * rows + 2) * cols + j] = -kInf;  // head 1, row 2
    SoftmaxMasks masks;
    masks.key_padding = key_padding.data();
    masks.attn = attn.data();
    masks.attn_head_stride = rows * cols;
    masks.attn_row_stride = cols;
    masks.masked_cols = cols;
    masks.causal = true;
    masks.first_row = cols / 3;
    std::vector<float> in = scores;
    in[(2 * rows + 3) * cols] = kInf;  // head 2, row 3 overflowed
    for (bool bf16_only : {false, true}) {
      std::vector<float> probs = in;
      std::vector<uint16_t> bf16(in.size(), 0x1234);
      MaskedSoftmax(probs.data(), heads, rows, cols, masks, bf16.data(), !bf16_only);
      for (int64_t hr = 0; hr < heads * rows; ++hr) {
        const int64_t h = hr / rows, r = hr % rows;
        std::vector<float> masked(cols);
        for (int64_t j = 0; j < cols; ++j) {
          const bool hidden = j > masks.first_row + r;
          masked[j] = hidden ? -kInf : in[hr * cols + j] + key_padding[j] + attn[hr * cols + j];
        }
        const std::vector<double> exact_row = ExactSoftmax(masked.data(), cols);
        const std::string where = "cols " + std::to_string(cols) + " head " + std::to_string(h) +
                                  " row " + std::to_string(r) + (bf16_only ? " bf16 only" : " f32");
        for (int64_t j = 0; j < cols; ++j) {
          const float got16 = Bf16ToFloat(bf16[hr * cols + j]);
          if (h == 2 && r == 3) {
            EXPECT_TRUE(std::isnan(got16)) << where;
            EXPECT_TRUE(bf16_only || std::isnan(probs[hr * cols + j])) << where;
            continue;
          }
          if (h == 1 && r == 2) {
            EXPECT_EQ(bf16[hr * cols + j], 0) << where;
            EXPECT_TRUE(bf16_only || probs[hr * cols + j] == 0.0f) << where;
            continue;
          }
          const double exact = exact_row[j];
          EXPECT_NEAR(got16, exact, exact * 4.1e-3 + 1e-30) << where << " col " << j;
          if (!bf16_only) {
            // 2e-6: the accurate exp (the cheap one is off by up to 4e-6).
            EXPECT_NEAR(probs[hr * cols + j], exact, exact * 2e-6 + 1e-30) << where << " col " << j;
            EXPECT_EQ(bf16[hr * cols + j], FloatToBf16(probs[hr * cols + j])) << where;
          }
        }
      }
    }
  }
}

TEST_P(KernelsIsaTest, F32SoftmaxWithBf16CopyIsTheRoundedF32Probabilities) {
  const int64_t rows = 4, cols = 33;
  std::vector<float> scores = RandomVector(rows * cols, 3, 5.0f);
  SoftmaxMasks masks;
  masks.masked_cols = cols;
  std::vector<uint16_t> bf16(scores.size());
  MaskedSoftmax(scores.data(), 1, rows, cols, masks, bf16.data(), /*f32_probs=*/true);
  std::vector<uint16_t> rounded(scores.size());
  ConvertToBf16(scores.data(), rounded.data(), static_cast<int64_t>(scores.size()));
  EXPECT_EQ(bf16, rounded);
}

TEST_P(KernelsIsaTest, OnlineSoftmaxBf16CopyMatchesItsF32Values) {
  const int64_t rows = 3, cols = 50;
  const std::vector<float> scores = RandomVector(rows * cols, 5, 20.0f);
  SoftmaxMasks masks;
  masks.masked_cols = cols;
  std::vector<float> stats(3 * rows), f32_scores = scores, bf16_scores = scores;
  auto run = [&](std::vector<float>& s, uint16_t* bf16) {
    const OnlineSoftmaxRows state{stats.data(), stats.data() + rows, stats.data() + 2 * rows};
    for (int64_t r = 0; r < rows; ++r) state.max[r] = -INFINITY, state.sum[r] = 0.0f;
    OnlineSoftmaxTile(s.data(), rows, cols, 0, masks, state, bf16);
    return std::vector<float>(stats.begin() + rows, stats.begin() + 2 * rows);  // sums
  };
  const std::vector<float> f32_sums = run(f32_scores, nullptr);
  std::vector<uint16_t> bf16(rows * cols);
  const std::vector<float> bf16_sums = run(bf16_scores, bf16.data());
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(bf16_sums[r], f32_sums[r], f32_sums[r] * 1e-5) << "row " << r;
  }
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_NEAR(Bf16ToFloat(bf16[i]), f32_scores[i], f32_scores[i] * 4.1e-3 + 1e-30) << i;
  }
}

TEST_P(KernelsIsaTest, OnlineSoftmaxBf16TileZeroesMaskedKeysAndKeepsNaN) {
  // Row 0: two masked keys in a tile; row 1: every key masked; row 2: a NaN
  // score (an overflow upstream). Two tiles, so the running state carries.
  const int64_t rows = 3, cols = 37, tiles = 2;
  std::vector<float> key_padding(tiles * cols, 0.0f);
  key_padding[4] = key_padding[cols + 20] = -INFINITY;
  std::vector<float> attn(rows * tiles * cols, 0.0f);
  for (int64_t j = 0; j < tiles * cols; ++j) attn[tiles * cols + j] = -INFINITY;
  SoftmaxMasks masks;
  masks.key_padding = key_padding.data();
  masks.attn = attn.data();
  masks.attn_row_stride = tiles * cols;
  masks.masked_cols = tiles * cols;
  std::vector<float> stats(3 * rows);
  const OnlineSoftmaxRows state{stats.data(), stats.data() + rows, stats.data() + 2 * rows};
  for (int64_t r = 0; r < rows; ++r) state.max[r] = -INFINITY, state.sum[r] = 0.0f;
  double expected_sum = 0.0, running_max = -INFINITY;
  for (int64_t t = 0; t < tiles; ++t) {
    std::vector<float> scores = RandomVector(rows * cols, 20 + t, 8.0f);
    scores[2 * cols + 9] = NAN;
    for (int64_t j = 0; j < cols; ++j) {
      if (key_padding[t * cols + j] == 0.0f) {
        running_max = std::max(running_max, static_cast<double>(scores[j]));
      }
    }
    std::vector<float> tile_scores = scores;
    std::vector<uint16_t> bf16(rows * cols, 0x1234);
    OnlineSoftmaxTile(scores.data(), rows, cols, t * cols, masks, state, bf16.data());
    expected_sum *= t == 0 ? 0.0 : state.rescale[0];
    for (int64_t j = 0; j < cols; ++j) {
      const double p = Bf16ToFloat(bf16[j]);
      if (key_padding[t * cols + j] != 0.0f) {
        EXPECT_EQ(bf16[j], 0) << "masked key " << t * cols + j;
      } else {
        const double exact = std::exp(tile_scores[j] - running_max);
        EXPECT_NEAR(p, exact, exact * 4.1e-3 + 1e-30) << "key " << t * cols + j;
        expected_sum += exact;
      }
      EXPECT_EQ(bf16[cols + j], 0) << "fully masked row, key " << t * cols + j;
    }
    EXPECT_EQ(state.max[0], static_cast<float>(running_max)) << "tile " << t;
  }
  EXPECT_NEAR(state.sum[0], expected_sum, expected_sum * 1e-5);
  EXPECT_EQ(state.sum[1], 0.0f) << "every key masked: nothing summed";
  EXPECT_TRUE(std::isnan(state.sum[2])) << "a NaN score must poison its row";
}

TEST(KernelsTest, SplitAndMergeHeadsMatchAPlainCopy) {
  // Head widths in bytes from 2 (one bf16 element) to beyond the inline
  // copy's 64-byte steps, in blocks of rows and not.
  for (int64_t head_bytes : {2, 6, 18, 64, 130, 256}) {
    for (int64_t block_rows : {3, 100}) {
      const int64_t heads = 3, rows = 7, layout_rows = 8, row_bytes = heads * head_bytes + 4;
      std::vector<uint8_t> src(rows * row_bytes);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 37 + 1);
      const HeadLayout layout{heads, head_bytes, layout_rows, block_rows};
      std::vector<uint8_t> split(layout_rows * heads * head_bytes, 0);
      SplitHeads(src.data(), row_bytes, rows, layout, split.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
          ASSERT_EQ(std::memcmp(split.data() + layout.Offset(h, r),
                                src.data() + r * row_bytes + h * head_bytes, head_bytes),
                    0)
              << "head bytes " << head_bytes << " row " << r << " head " << h;
        }
      }
      std::vector<uint8_t> merged(rows * row_bytes, 0);
      MergeHeads(split.data(), layout, rows, merged.data(), row_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ(std::memcmp(merged.data() + r * row_bytes, src.data() + r * row_bytes,
                              heads * head_bytes),
                  0)
            << "head bytes " << head_bytes << " row " << r;
        for (int64_t i = heads * head_bytes; i < row_bytes; ++i) {
          EXPECT_EQ(merged[r * row_bytes + i], 0) << "wrote past the heads, row " << r;
        }
      }
    }
  }
}

// The small path's scores (keys taken 16 at a time up to heads of 256;
// with AVX512-BF16 as pairs, heads of an even depth) against
// double-precision dot products: tails of a key tile, one key, an odd depth,
// and a head too deep for the tiles.
TEST_P(KernelsIsaTest, SmallScoresMatchDoubleDotProductsInF32AndBf16) {
  struct Shape {
    int64_t batch, rows, cols, d;
  };
  for (const Shape& sh :
       {Shape{1, 1, 1, 8}, Shape{2, 3, 17, 64}, Shape{3, 16, 16, 64}, Shape{2, 15, 20, 64},
        Shape{1, 5, 33, 256}, Shape{2, 2, 5, 300}, Shape{1, 3, 7, 9}, Shape{1, 2, 40, 2}}) {
    const std::vector<float> q = RandomVector(sh.batch * sh.rows * sh.d, 1);
    const std::vector<float> k = RandomVector(sh.batch * sh.cols * sh.d, 2);
    std::vector<uint16_t> q16(q.size()), k16(k.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = FloatToBf16(q[i]);
    for (size_t i = 0; i < k.size(); ++i) k16[i] = FloatToBf16(k[i]);
    const float scale = 0.125f;
    std::vector<float> f32(sh.batch * sh.rows * sh.cols), bf16(f32.size());
    SmallScores(q.data(), k.data(), f32.data(), sh.batch, sh.rows, sh.cols, sh.d, scale);
    SmallScoresBf16(q16.data(), k16.data(), bf16.data(), sh.batch, sh.rows, sh.cols, sh.d, scale);
    for (int64_t b = 0; b < sh.batch; ++b) {
      for (int64_t i = 0; i < sh.rows; ++i) {
        for (int64_t j = 0; j < sh.cols; ++j) {
          double want = 0, want16 = 0;
          for (int64_t c = 0; c < sh.d; ++c) {
            const int64_t qi = (b * sh.rows + i) * sh.d + c, kj = (b * sh.cols + j) * sh.d + c;
            want += double{q[qi]} * k[kj];
            want16 += double{Bf16ToFloat(q16[qi])} * Bf16ToFloat(k16[kj]);
          }
          const int64_t at = (b * sh.rows + i) * sh.cols + j;
          EXPECT_NEAR(f32[at], want * scale, 1e-5) << "d " << sh.d << " at " << at;
          EXPECT_NEAR(bf16[at], want16 * scale, 1e-5) << "bf16, d " << sh.d << " at " << at;
        }
      }
    }
  }
}

// The small path's context (probabilities . values) against double
// precision: in f32 exactly to f32 rounding; in bf16 within the rounding of
// the probabilities to bf16 (AVX512-BF16) and of the output: odd key counts,
// a column count off 32, more keys than one chunk of 512.
TEST_P(KernelsIsaTest, SmallContextMatchesDoubleProductsInF32AndBf16) {
  struct Shape {
    int64_t batch, rows, cols, dv;
  };
  for (const Shape& sh :
       {Shape{1, 1, 1, 8}, Shape{2, 3, 17, 64}, Shape{3, 16, 16, 64}, Shape{2, 15, 20, 64},
        Shape{1, 2, 33, 40}, Shape{1, 2, 1100, 32}, Shape{2, 1, 5, 300}}) {
    std::vector<float> probs = RandomVector(sh.batch * sh.rows * sh.cols, 3);
    for (float& x : probs) x = std::abs(x) / static_cast<float>(sh.cols);
    const std::vector<float> v = RandomVector(sh.batch * sh.cols * sh.dv, 4);
    std::vector<uint16_t> v16(v.size());
    for (size_t i = 0; i < v.size(); ++i) v16[i] = FloatToBf16(v[i]);
    std::vector<float> f32(sh.batch * sh.rows * sh.dv);
    std::vector<uint16_t> bf16(f32.size());
    SmallContext(probs.data(), v.data(), f32.data(), sh.batch, sh.rows, sh.cols, sh.dv);
    SmallContextBf16(probs.data(), v16.data(), bf16.data(), sh.batch, sh.rows, sh.cols, sh.dv);
    for (int64_t b = 0; b < sh.batch; ++b) {
      for (int64_t i = 0; i < sh.rows; ++i) {
        for (int64_t c = 0; c < sh.dv; ++c) {
          double want = 0, want16 = 0, magnitude16 = 0;
          for (int64_t j = 0; j < sh.cols; ++j) {
            const double p = probs[(b * sh.rows + i) * sh.cols + j];
            const int64_t vj = (b * sh.cols + j) * sh.dv + c;
            want += p * v[vj];
            want16 += p * Bf16ToFloat(v16[vj]);
            magnitude16 += std::abs(p * Bf16ToFloat(v16[vj]));
          }
          const int64_t at = (b * sh.rows + i) * sh.dv + c;
          EXPECT_NEAR(f32[at], want, 1e-5) << "dv " << sh.dv << " at " << at;
          // Each probability to bf16 (at most 2^-8 relative: 8 significant
          // bits), the output too.
          EXPECT_NEAR(Bf16ToFloat(bf16[at]), want16,
                      (magnitude16 + std::abs(want16)) * 0x1p-8 + 1e-6)
              << "bf16, dv " << sh.dv << " at " << at;
        }
      }
    }
  }
}

TEST_P(KernelsIsaTest, LargeConversionToBf16RoundsEveryElementToNearestEven) {
  // Above the two-thread threshold and not a multiple of the chunk size.
  const int64_t n = (int64_t{1} << 18) + 12345;
  std::vector<float> in(n);
  std::mt19937 gen(1);
  for (float& x : in) {
    const uint32_t bits = static_cast<uint32_t>(gen()) & 0xbfffffffu;  // finite values
    std::memcpy(&x, &bits, 4);
  }
  in[0] = 1.0f + std::ldexp(1.0f, -8);      // tie, rounds down to even 1.0
  in[1] = 1.0f + 3 * std::ldexp(1.0f, -8);  // tie, rounds up to even
  std::vector<uint16_t> out(n);
  ConvertToBf16(in.data(), out.data(), n);
  EXPECT_EQ(out[0], 0x3f80);
  EXPECT_EQ(out[1], 0x3f82);
  for (int64_t i = 0; i < n; ++i) {
    // The nearest bf16: the candidate below or above, ties to the even one.
    uint32_t bits;
    std::memcpy(&bits, &in[i], 4);
    const uint16_t below = static_cast<uint16_t>(bits >> 16);
    const double lo = Bf16ToFloat(below), hi = Bf16ToFloat(below + 1);
    const double x = std::fabs(static_cast<double>(in[i]));
    const double dlo = x - std::fabs(lo), dhi = std::fabs(hi) - x;
    uint16_t expected = dlo < dhi   ? below
                        : dlo > dhi ? below + 1
                                    : ((below & 1) == 0 ? below : below + 1);
    // The AVX512-BF16 conversion reads denormals as zero (of their sign).
    if (GetParam() == KernelIsa::kAvx512Bf16 && std::fpclassify(in[i]) == FP_SUBNORMAL) {
      expected = static_cast<uint16_t>(bits >> 31 << 15);
    }
    ASSERT_EQ(out[i], expected) << "element " << i << " = " << in[i];
  }
}

// NaN stays NaN (quiet, its sign kept) and infinities stay infinite through
// every bf16 conversion: the vector rows at each level and dtype.h's scalar
// FloatToBf16 agree. Rounding a NaN like a number would carry its mantissa
// into the exponent and sign: 0x7fffffff would become -0.
TEST_P(KernelsIsaTest, ConversionToBf16KeepsNaNAndInfinity) {
  const uint32_t specials[] = {0x7fffffffu, 0xffffffffu, 0x7f800001u, 0x7fc00000u,
                               0xff800000u, 0x7f800000u, 0x7f7fffffu, 0x00000000u};
  constexpr int64_t kCopies = 5;  // 40 values: whole vectors and a tail
  std::vector<float> in;
  for (int64_t c = 0; c < kCopies; ++c) {
    for (uint32_t bits : specials) {
      float x;
      std::memcpy(&x, &bits, 4);
      in.push_back(x);
    }
  }
  std::vector<uint16_t> out(in.size());
  ConvertToBf16(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], 4);
    EXPECT_EQ(out[i], FloatToBf16(in[i])) << std::hex << "bits 0x" << bits;
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(out[i]))) << std::hex << "bits 0x" << bits;
      EXPECT_EQ(out[i] >> 15, bits >> 31) << "the sign is kept";
    }
  }
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
}

// An int8 cache row keeps each element within half a step (scale / 2) of
// its value, scale = max |x| / 127: at ordinary sizes, at 1e30 (no
// overflow) and at 2e-37 (where 127 / max |x| would overflow);
// an all-zero row gets scale 0 and zeros, never NaN; a row holding inf or
// NaN gets a NaN scale, so attention over it is NaN as PyTorch's is.
TEST(KernelsTest, Int8RowsRoundWithTheirScaleAtTheEdges) {
  for (const float size : {1.0f, 1e30f, 4e-37f}) {
    std::vector<float> row = RandomVector(40, 3);
    for (float& x : row) x *= size;
    row[7] = -0.5f * size;  // |largest| is exactly representable as -127
    for (float& x : row) x = std::clamp(x, -0.5f * size, 0.5f * size);
    std::vector<int8_t> out(40 * 3, 99);
    const float scale = QuantizeInt8(row.data(), 40, out.data(), 3);  // strided
    EXPECT_FLOAT_EQ(scale, 0.5f * size / 127.0f) << size;
    EXPECT_EQ(out[7 * 3], -127) << size;
    for (int c = 0; c < 40; ++c) {
      EXPECT_LE(std::fabs(out[c * 3] * scale - row[c]), 0.5f * scale * 1.001f)
          << size << " element " << c;
      EXPECT_EQ(out[c * 3 + 1], 99) << "wrote between the strided elements";
    }
  }
  const std::vector<float> zeros(16, 0.0f);
  std::vector<int8_t> out(16, 5);
  EXPECT_EQ(QuantizeInt8(zeros.data(), 16, out.data(), 1), 0.0f);
  EXPECT_EQ(out, std::vector<int8_t>(16, 0));
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> row(16, 1.0f);
    row[4] = bad;
    EXPECT_TRUE(std::isnan(QuantizeInt8(row.data(), 16, out.data(), 1))) << bad;
  }
}

// The int8 step loops compute with the values the cache stands for
// (element x scale): scores against keys and context over values, at every
// kernel level this CPU has (portable, AVX2, AVX-512), for head widths
// through each path's column blocks and remainders, f32 and bf16 queries.
TEST_P(KernelsIsaTest, Int8BlockScoresAndContextUseTheScaledValues) {
  constexpr int64_t kTokens = 32;
  for (const int64_t d : {int64_t{5}, int64_t{8}, int64_t{24}, int64_t{64}, int64_t{72}}) {
    for (const int64_t n : {int64_t{32}, int64_t{13}}) {
      std::vector<int8_t> kt(d * kTokens), v(kTokens * d);
      std::mt19937 gen(static_cast<uint32_t>(d + n));
      for (int8_t& x : kt) x = static_cast<int8_t>(static_cast<int>(gen() % 255) - 127);
      for (int8_t& x : v) x = static_cast<int8_t>(static_cast<int>(gen() % 255) - 127);
      const std::vector<float> key_scales = RandomVector(kTokens, 4);
      const std::vector<float> q = RandomVector(d, 5);
      std::vector<uint16_t> q16(d);
      ConvertToBf16(q.data(), q16.data(), d);
      const float scale = 0.125f;
      std::vector<float> got(kTokens, -7.0f), got16(kTokens, -7.0f);
      BlockScoresF32Int8(q.data(), kt.data(), key_scales.data(), got.data(), n, d, scale);
      BlockScoresBf16Int8(q16.data(), kt.data(), key_scales.data(), got16.data(), n, d, scale);
      for (int64_t j = 0; j < kTokens; ++j) {
        if (j >= n) {
          EXPECT_EQ(got[j], -7.0f) << "wrote past n";
          continue;
        }
        double want = 0, want16 = 0;
        for (int64_t c = 0; c < d; ++c) {
          want += double{q[c]} * kt[c * kTokens + j];
          want16 += double{Bf16ToFloat(q16[c])} * kt[c * kTokens + j];
        }
        want *= scale * key_scales[j];
        want16 *= scale * key_scales[j];
        EXPECT_NEAR(got[j], want, 1e-5 * (1 + std::fabs(want))) << "d " << d << " j " << j;
        EXPECT_NEAR(got16[j], want16, 1e-5 * (1 + std::fabs(want16))) << "d " << d;
      }
      const std::vector<float> probs = RandomVector(kTokens, 6);
      std::vector<float> acc = RandomVector(d, 7);
      std::vector<double> want(acc.begin(), acc.end());
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < d; ++c) want[c] += double{probs[j]} * v[j * d + c];
      }
      AccumulateContextInt8(probs.data(), v.data(), acc.data(), n, d);
      for (int64_t c = 0; c < d; ++c) {
        EXPECT_NEAR(acc[c], want[c], 1e-4 * (1 + std::fabs(want[c]))) << "d " << d << " c " << c;
      }
    }
  }
}

// The bf16 cache's step loops at every kernel level this CPU has (with
// AVX512-BF16: pair dot products, rows interleaved and put back in token
// and column order): scores of a bf16 query and an f32 one against bf16
// keys, and the context over bf16 values (after MergeSplitContext), for
// head widths through the 64-column blocks, odd widths and remainders, and
// partial blocks whose unread slots hold NaN. A `next` block changes
// nothing.
TEST_P(KernelsIsaTest, Bf16BlockScoresAndContextMatchTheWidenedValues) {
  constexpr int64_t kTokens = 32;
  const bool dot = GetParam() == KernelIsa::kAvx512Bf16;
  for (const int64_t d :
       {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{64}, int64_t{72}, int64_t{128}}) {
    for (const int64_t n : {int64_t{32}, int64_t{13}, int64_t{1}}) {
      std::vector<uint16_t> kt(d * kTokens), v(kTokens * d);
      ConvertToBf16(RandomVector(d * kTokens, 3).data(), kt.data(), d * kTokens);
      ConvertToBf16(RandomVector(kTokens * d, 4).data(), v.data(), kTokens * d);
      const uint16_t nan_bits = 0x7fc0;
      for (int64_t j = n; j < kTokens; ++j) {  // unwritten slots: the values may hold anything
        for (int64_t c = 0; c < d; ++c) v[j * d + c] = nan_bits;
      }
      const std::vector<float> q = RandomVector(d, 5);
      std::vector<uint16_t> q16(d);
      ConvertToBf16(q.data(), q16.data(), d);
      const std::vector<uint16_t> elsewhere(d * kTokens, nan_bits);
      const float scale = 0.125f;
      std::vector<float> got(kTokens, -7.0f), got32(kTokens, -7.0f);
      BlockScoresBf16(q16.data(), kt.data(), got.data(), n, d, scale, elsewhere.data());
      BlockScoresF32Bf16(q.data(), kt.data(), got32.data(), n, d, scale);
      for (int64_t j = 0; j < kTokens; ++j) {
        if (j >= n) {
          EXPECT_EQ(got[j], -7.0f) << "wrote past n";
          EXPECT_EQ(got32[j], -7.0f) << "wrote past n";
          continue;
        }
        double want = 0, want32 = 0;
        for (int64_t c = 0; c < d; ++c) {
          const double key = Bf16ToFloat(kt[c * kTokens + j]);
          want += Bf16ToFloat(q16[c]) * key;
          want32 += q[c] * key;
        }
        EXPECT_NEAR(got[j], want * scale, 1e-5 * (1 + std::fabs(want))) << "d " << d << " j " << j;
        EXPECT_NEAR(got32[j], want32 * scale, 1e-5 * (1 + std::fabs(want32))) << "d " << d;
      }
      const std::vector<float> probs = RandomVector(kTokens, 6);
      const std::vector<float> start = RandomVector(d, 7);
      std::vector<double> want(start.begin(), start.end());
      for (int64_t j = 0; j < n; ++j) {
        // The dot products (columns in blocks of 64) take the probabilities
        // rounded to bf16; the remaining columns, f32 ones.
        uint16_t p16 = 0;
        ConvertToBf16(&probs[j], &p16, 1);
        for (int64_t c = 0; c < d; ++c) {
          const double p = dot && c < d / 64 * 64 ? Bf16ToFloat(p16) : probs[j];
          want[c] += p * Bf16ToFloat(v[j * d + c]);
        }
      }
      // acc starts in the split order the loop keeps (MergeSplitContext
      // is its inverse), so the sums land on the right columns.
      std::vector<float> acc = start;
      for (int64_t c0 = 0; c0 + 64 <= d; c0 += 64) {
        for (int i = 0; i < 16; ++i) {
          acc[c0 + i] = start[c0 + 2 * i];
          acc[c0 + 16 + i] = start[c0 + 2 * i + 1];
          acc[c0 + 32 + i] = start[c0 + 32 + 2 * i];
          acc[c0 + 48 + i] = start[c0 + 33 + 2 * i];
        }
      }
      AccumulateContextBf16(probs.data(), v.data(), acc.data(), n, d, elsewhere.data());
      MergeSplitContext(acc.data(), d);
      for (int64_t c = 0; c < d; ++c) {
        EXPECT_NEAR(acc[c], want[c], 1e-5 * (1 + std::fabs(want[c])))
            << "d " << d << " n " << n << " c " << c;
      }
    }
  }
}

}  // namespace
}  // namespace mha
