// FlashAttentionBf16 (engine/ops/flash_bf16.h) against softmax(masked
// scores) . v computed in double from the same bf16 inputs: every row
// group size, partial key tiles, head sizes that take several or partial
// vectors, each mask, rows whose keys are all masked for a while or for
// good, and overflow.
#include "engine/ops/flash_bf16.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  int64_t rows = 1, keys = 1, dqk = 2, dv = 16;
  bool pad = false, attn = false, causal = false;
  int64_t first_row = 0;
  int64_t masked_cols = -1;  // -1: every key
  int64_t padded_keys = 0;   // the first this many keys get -inf padding
};

struct Data {
  std::vector<uint16_t> q, k, v;
  std::vector<float> pad, attn;
  SoftmaxMasks masks;
};

std::vector<uint16_t> RandomBf16(int64_t n, float range, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-range, range);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (uint16_t& x : out) x = FloatToBf16(dist(rng));
  return out;
}

Data Make(const Problem& p, uint32_t seed) {
  std::mt19937 rng(seed);
  Data d;
  d.q = RandomBf16(p.rows * p.dqk, 1.0f, rng);
  d.k = RandomBf16(p.keys * p.dqk, 1.0f, rng);
  d.v = RandomBf16(p.keys * p.dv, 1.0f, rng);
  d.masks.masked_cols = p.masked_cols < 0 ? p.keys : p.masked_cols;
  std::uniform_real_distribution<float> add(-2.0f, 2.0f);
  if (p.pad) {
    d.pad.resize(static_cast<size_t>(d.masks.masked_cols));
    for (size_t j = 0; j < d.pad.size(); ++j) {
      d.pad[j] = static_cast<int64_t>(j) < p.padded_keys ? kNegInf : add(rng);
    }
    d.masks.key_padding = d.pad.data();
  }
  if (p.attn) {
    d.attn.resize(static_cast<size_t>(p.rows * d.masks.masked_cols));
    for (float& x : d.attn) x = add(rng);
    d.masks.attn = d.attn.data();
    d.masks.attn_row_stride = d.masks.masked_cols;
  }
  d.masks.causal = p.causal;
  d.masks.first_row = p.first_row;
  return d;
}

// softmax(scale * q . k + masks) . v per row, in double; zeros for a row
// whose keys are all masked.
std::vector<double> Reference(const Problem& p, const Data& d, float scale) {
  std::vector<double> out(static_cast<size_t>(p.rows * p.dv), 0.0);
  const int64_t masked = d.masks.masked_cols;
  for (int64_t r = 0; r < p.rows; ++r) {
    std::vector<double> s(static_cast<size_t>(p.keys));
    double max = -INFINITY;
    for (int64_t j = 0; j < p.keys; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < p.dqk; ++c) {
        dot += double{Bf16ToFloat(d.q[r * p.dqk + c])} * Bf16ToFloat(d.k[j * p.dqk + c]);
      }
      double x = scale * dot;
      if (j < masked) {
        if (p.pad) x += d.pad[j];
        if (p.attn) x += d.attn[r * masked + j];
        if (p.causal && j > p.first_row + r) x = -INFINITY;
      }
      s[j] = x;
      max = std::max(max, x);
    }
    if (max == -INFINITY) continue;
    double sum = 0.0;
    for (double& x : s) sum += (x = std::exp(x - max));
    for (int64_t j = 0; j < p.keys; ++j) {
      for (int64_t c = 0; c < p.dv; ++c) {
        out[r * p.dv + c] += s[j] / sum * Bf16ToFloat(d.v[j * p.dv + c]);
      }
    }
  }
  return out;
}

std::vector<float> RunKernel(const Problem& p, const Data& d, float scale) {
  std::vector<uint32_t> pairs(static_cast<size_t>(kFlashBf16TileKeys * (p.dqk + p.dv) / 2));
  std::vector<float> acc(static_cast<size_t>(p.rows * p.dv)), stats(2 * p.rows);
  std::vector<uint16_t> context(static_cast<size_t>(p.rows * p.dv));
  FlashBf16Block b;
  b.q = d.q.data();
  b.k = d.k.data();
  b.v = d.v.data();
  b.context = context.data();
  b.rows = p.rows;
  b.keys = p.keys;
  b.dqk = p.dqk;
  b.dv = p.dv;
  b.scale = scale;
  b.masks = d.masks;
  FlashBf16Scratch s;
  s.key_pairs = pairs.data();
  s.value_pairs = pairs.data() + kFlashBf16TileKeys * p.dqk / 2;
  s.acc = acc.data();
  s.max = stats.data();
  s.sum = stats.data() + p.rows;
  FlashAttentionBf16(b, s);
  std::vector<float> out(context.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToFloat(context[i]);
  return out;
}

class FlashBf16Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ActiveKernelIsa() != KernelIsa::kAvx512Bf16) {
      GTEST_SKIP() << "the kernel needs AVX512-BF16, which this CPU lacks (the engine then "
                      "uses oneDNN's products; tiled_attention_test covers that path)";
    }
  }
};

// Probabilities are rounded to bf16 for the product (2^-9 relative each)
// and the output to bf16: 6e-3 with values in [-1, 1].
constexpr double kTolerance = 6e-3;

void ExpectMatches(const Problem& p, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "rows " << p.rows << " keys " << p.keys << " dqk " << p.dqk << " dv " << p.dv
               << " pad " << p.pad << " attn " << p.attn << " causal " << p.causal << " first_row "
               << p.first_row << " masked_cols " << p.masked_cols << " padded " << p.padded_keys);
  const Data d = Make(p, seed);
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.dqk));
  const std::vector<double> want = Reference(p, d, scale);
  const std::vector<float> got = RunKernel(p, d, scale);
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, kTolerance);
}

TEST_F(FlashBf16Test, EveryGroupSizeAndPartialTileMatchesTheExactProduct) {
  uint32_t seed = 1;
  for (const int64_t rows : {1, 2, 3, 4, 5, 9, 34}) {
    for (const int64_t keys : {1, 2, 63, 64, 65, 130}) {
      ExpectMatches(Problem{rows, keys, 64, 64}, seed++);
    }
  }
}

TEST_F(FlashBf16Test, HeadSizesOfOneToSeveralVectorsMatch) {
  uint32_t seed = 100;
  for (const auto& [dqk, dv] : {std::pair<int64_t, int64_t>{2, 16},
                                {16, 16},
                                {30, 48},
                                {64, 80},
                                {32, 128},
                                {128, 112},
                                {66, 32}}) {
    ExpectMatches(Problem{7, 100, dqk, dv}, seed++);
  }
}

TEST_F(FlashBf16Test, MasksMatchTheirExactEffect) {
  uint32_t seed = 200;
  for (const bool pad : {false, true}) {
    for (const bool attn : {false, true}) {
      for (const bool causal : {false, true}) {
        for (const int64_t first_row : {0, 70}) {
          Problem p{11, 150, 32, 32, pad, attn, causal, first_row};
          ExpectMatches(p, seed++);
          p.masked_cols = 148;  // two appended keys (bias_kv, zero_attn): never masked
          ExpectMatches(p, seed++);
        }
      }
    }
  }
}

// Keys masked at the front: every row's first tiles add nothing (the
// running max stays -inf), then later tiles count. With causal rows
// beside them, some rows of a group wait while others already count.
TEST_F(FlashBf16Test, RowsMaskedForTheFirstTilesStartLater) {
  ExpectMatches(Problem{6, 200, 32, 32, true, false, false, 0, -1, 130}, 300);
  ExpectMatches(Problem{6, 200, 32, 32, true, false, true, 60, -1, 64}, 301);
  ExpectMatches(Problem{9, 70, 16, 16, false, false, true, 0, -1, 0}, 302);
}

// Scores that climb from tile to tile, by more than the kernel lets a
// running max lag (8 in base 2: the max moves and the sums are rescaled)
// and by less (the max stays and probabilities pass 1), and scores that
// fall: each row leans on keys k + 4 * key / 64 with its own weight (a
// max that never moved would overflow).
TEST_F(FlashBf16Test, ScoresThatClimbOrFallAcrossTilesMatch) {
  for (const bool causal : {false, true}) {
    const Problem p{8, 300, 32, 32, false, false, causal, 290};
    Data d = Make(p, causal ? 601 : 600);
    const float lean[] = {2.0f, 1.0f, 0.25f, 0.1f, -0.25f, -1.0f, 0.5f, -2.0f};
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.dqk; ++c) {
        const float q = Bf16ToFloat(d.q[r * p.dqk + c]);
        d.q[r * p.dqk + c] = FloatToBf16(0.2f * q + lean[r]);
      }
    }
    for (int64_t j = 0; j < p.keys; ++j) {
      for (int64_t c = 0; c < p.dqk; ++c) {
        const float k = Bf16ToFloat(d.k[j * p.dqk + c]);
        d.k[j * p.dqk + c] = FloatToBf16(k + 4.0f * static_cast<float>(j) / 64.0f);
      }
    }
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const float scale = 1.0f / std::sqrt(static_cast<float>(p.dqk));
    const std::vector<double> want = Reference(p, d, scale);
    const std::vector<float> got = RunKernel(p, d, scale);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], kTolerance) << i;
  }
}

TEST_F(FlashBf16Test, RowsWithEveryKeyMaskedGiveZeros) {
  const Problem p{5, 90, 16, 32, true, false, false, 0, -1, 90};
  const std::vector<float> got = RunKernel(p, Make(p, 400), 0.25f);
  for (const float x : got) EXPECT_EQ(x, 0.0f);
}

// Scores past f32's range poison their rows with NaN (as the untiled
// softmax does), never finite garbage; the other rows of the group stay
// right.
TEST_F(FlashBf16Test, OverflowingScoresGiveNaNRows) {
  const Problem p{4, 80, 16, 16};
  Data d = Make(p, 500);
  for (int64_t c = 0; c < p.dqk; ++c) d.q[1 * p.dqk + c] = FloatToBf16(3e38f);
  const std::vector<float> got = RunKernel(p, d, 1.0f);
  const std::vector<double> want = Reference(p, d, 1.0f);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.dv; ++c) {
      const float x = got[r * p.dv + c];
      if (r == 1) {
        EXPECT_TRUE(std::isnan(x)) << "row 1 col " << c << " = " << x;
      } else {
        EXPECT_NEAR(x, want[r * p.dv + c], kTolerance) << "row " << r << " col " << c;
      }
    }
  }
}

}  // namespace
}  // namespace mha
