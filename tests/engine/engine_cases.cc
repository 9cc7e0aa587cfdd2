#include "tests/engine/engine_cases.h"

#include <cmath>

#include "gtest/gtest.h"
#include "tests/engine/test_models.h"

namespace mha::testing {
namespace {

// Fills one mask of `n` elements: about a third masked; additive values
// mirror the booleans so the reference sees the same thing.
void FillMask(MaskKind kind, int64_t n, uint32_t seed, std::vector<uint8_t>& bools,
              std::vector<float>& floats, std::vector<float>& additive) {
  const std::vector<float> r = RandomVector(n, seed, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    const bool masked = r[i] > 0.33f;
    const float value = kind == MaskKind::kBool ? (masked ? -kInf : 0.0f) : (masked ? -kInf : r[i]);
    bools.push_back(masked);
    floats.push_back(value);
    additive.push_back(value);
  }
}

}  // namespace

AttentionDims Dims(int64_t e, int64_t h) { return MakeDims(e, h); }

void AttachMask(MaskKind kind, const std::vector<uint8_t>& bools, const std::vector<float>& floats,
                MaskView& view) {
  if (kind == MaskKind::kNone) return;
  view.dtype = kind == MaskKind::kBool ? DType::kBool : DType::kF32;
  view.data = kind == MaskKind::kBool ? static_cast<const void*>(bools.data())
                                      : static_cast<const void*>(floats.data());
  view.num_elements = static_cast<int64_t>(bools.size());
}

Built Build(const Case& c, uint32_t seed) {
  const AttentionDims& d = c.dims;
  const bool self = c.kv_lens.empty();
  Built b;
  b.batch.q_offsets = {0};
  b.batch.kv_offsets = {0};
  for (size_t i = 0; i < c.q_lens.size(); ++i) {
    ReferenceSequence s;
    s.q_len = c.q_lens[i];
    s.kv_len = self ? s.q_len : c.kv_lens[i];
    s.causal = c.causal;
    s.query = RandomVector(s.q_len * d.embed_dim, seed + 10 * i + 1);
    if (!self) {
      s.key = RandomVector(s.kv_len * d.kdim, seed + 10 * i + 2);
      if (!c.value_is_key) s.value = RandomVector(s.kv_len * d.vdim, seed + 10 * i + 3);
    }
    if (c.key_padding != MaskKind::kNone) {
      FillMask(c.key_padding, s.kv_len, seed + 10 * i + 4, b.key_pad_bool, b.key_pad_f32,
               s.key_padding);
    }
    if (c.attn_mask != MaskKind::kNone) {
      b.batch.attn_mask_offsets.push_back(static_cast<int64_t>(b.mask_bool.size()));
      const int64_t heads = c.attn_per_head ? d.num_heads : 1;
      FillMask(c.attn_mask, heads * s.q_len * s.kv_len, seed + 10 * i + 5, b.mask_bool, b.mask_f32,
               s.attn_mask);
    }
    b.query.insert(b.query.end(), s.query.begin(), s.query.end());
    b.key.insert(b.key.end(), s.key.begin(), s.key.end());
    b.value.insert(b.value.end(), s.value.begin(), s.value.end());
    b.batch.q_offsets.push_back(b.batch.q_offsets.back() + s.q_len);
    b.batch.kv_offsets.push_back(b.batch.kv_offsets.back() + s.kv_len);
    b.sequences.push_back(std::move(s));
  }
  b.batch.kind = b.key.empty()     ? AttentionKind::kSelf
                 : b.value.empty() ? AttentionKind::kCrossValueIsKey
                                   : AttentionKind::kCross;
  b.batch.query = b.query;
  b.batch.key = b.key;
  b.batch.value = b.value;
  b.batch.is_causal = c.causal;
  b.batch.attn_mask_per_head = c.attn_per_head;
  AttachMask(c.key_padding, b.key_pad_bool, b.key_pad_f32, b.batch.key_padding_mask);
  AttachMask(c.attn_mask, b.mask_bool, b.mask_f32, b.batch.attn_mask);
  return b;
}

RunResult RunEngine(const MhaEngine& engine, const Case& c, const Built& b, bool with_weights,
                    Workspace* ws) {
  RunResult r;
  r.output.assign(b.batch.q_offsets.back() * c.dims.embed_dim, -1.0f);
  if (with_weights) r.weights.assign(engine.WeightsElements(b.batch, c.per_head_weights), -1.0f);
  AttentionOutputs out{absl::MakeSpan(r.output), absl::MakeSpan(r.weights), c.per_head_weights};
  std::unique_ptr<Workspace> own;
  if (ws == nullptr) own = engine.NewWorkspace(), ws = own.get();
  const absl::Status s = engine.Run(b.batch, out, *ws);
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

float MaxAbsDiff(const float* a, const float* b, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(a[i] - b[i]);
    if (!(diff <= m)) m = std::isnan(diff) ? kInf : diff;
  }
  return m;
}

void ExpectMatchesReference(const Case& c, const PackedWeights& w, const Built& b,
                            const RunResult& got, float tolerance, bool check_weights) {
  const AttentionDims& d = c.dims;
  int64_t weights_at = 0;
  for (size_t i = 0; i < b.sequences.size(); ++i) {
    const ReferenceSequence& s = b.sequences[i];
    const ReferenceResult ref = ReferenceAttention(d, w, s);
    const float* out = got.output.data() + b.batch.q_offsets[i] * d.embed_dim;
    EXPECT_LE(MaxAbsDiff(out, ref.output.data(), ref.output.size()), tolerance)
        << c.name << " output of sequence " << i;
    if (!check_weights) continue;
    const int64_t n = s.q_len * (s.kv_len + d.extra_keys());
    std::vector<float> expected = ref.head_weights;
    if (!c.per_head_weights) {  // average over heads
      expected.assign(n, 0.0f);
      for (int64_t h = 0; h < d.num_heads; ++h)
        for (int64_t j = 0; j < n; ++j) expected[j] += ref.head_weights[h * n + j] / d.num_heads;
    }
    EXPECT_LE(MaxAbsDiff(got.weights.data() + weights_at, expected.data(), expected.size()),
              tolerance)
        << c.name << " weights of sequence " << i;
    weights_at += static_cast<int64_t>(expected.size());
  }
  if (check_weights) {
    EXPECT_EQ(weights_at, static_cast<int64_t>(got.weights.size()));
  }
}

std::unique_ptr<MhaEngine> MakeEngine(const AttentionDims& d, const PackedWeights& w,
                                      EngineOptions options) {
  absl::StatusOr<std::unique_ptr<MhaEngine>> engine = MhaEngine::Create(d, w, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

AttentionDims With(AttentionDims d, void (*edit)(AttentionDims&)) {
  edit(d);
  return d;
}

// One case per line reads as a table.
// clang-format off
std::vector<Case> AllCases() {
  const AttentionDims base = Dims(24, 3);
  const AttentionDims cross = With(base, [](AttentionDims& d) { d.kdim = 16, d.vdim = 20; });
  const AttentionDims no_bias = With(base, [](AttentionDims& d) { d.bias = false; });
  const AttentionDims bias_kv = With(base, [](AttentionDims& d) { d.add_bias_kv = true; });
  const AttentionDims zero_attn = With(base, [](AttentionDims& d) { d.add_zero_attn = true; });
  const AttentionDims both_extra = With(cross, [](AttentionDims& d) {
    d.add_bias_kv = true, d.add_zero_attn = true;
  });
  const AttentionDims einsum = With(base, [](AttentionDims& d) {
    d.qk_head_dim = 5, d.v_head_dim = 7;
  });
  const AttentionDims norm = With(base, [](AttentionDims& d) {
    d.post_norm = true, d.norm_eps = 1e-3f;
  });
  using M = MaskKind;
  return {
      {"self", base, {5, 5}, {}},
      {"self_L1", base, {1}, {}},
      {"self_ragged", base, {1, 7, 3, 3}, {}},
      {"cross_L_ne_S", cross, {3, 4}, {6, 2}},
      {"cross_S1", cross, {4}, {1}},
      {"cross_value_is_key", With(base, [](AttentionDims& d) { d.kdim = d.vdim = 10; }),
       {3, 2}, {5, 5}, true},
      {"no_bias", no_bias, {4}, {}},
      {"key_padding_bool", base, {4, 6}, {}, false, M::kBool},
      {"key_padding_float", cross, {3, 3}, {5, 5}, false, M::kFloat},
      {"attn_mask_bool_per_head", base, {4, 2}, {}, false, M::kNone, M::kBool},
      {"attn_mask_float_shared", cross, {3, 3}, {4, 4}, false, M::kNone, M::kFloat, false},
      {"both_masks", base, {5, 5}, {}, false, M::kBool, M::kFloat, true},
      {"causal", base, {6, 3}, {}, false, M::kNone, M::kNone, true, true},
      {"causal_cross_L_gt_S", cross, {6}, {4}, false, M::kBool, M::kNone, true, true},
      {"causal_with_masks", base, {5}, {}, false, M::kFloat, M::kBool, false, true},
      {"per_head_weights", base, {4, 2}, {3, 5}, false, M::kBool, M::kNone, true, false, true},
      {"bias_kv", bias_kv, {4, 3}, {}, false, M::kBool, M::kNone, true, false, true},
      {"zero_attn", zero_attn, {3}, {2}, false, M::kNone, M::kBool, true, true},
      {"bias_kv_zero_attn_cross", both_extra, {3, 1}, {4, 2}, false, M::kBool, M::kBool, true,
       false, true},
      {"einsum_head_dims", einsum, {4, 4}, {}, false, M::kBool, M::kNone, true, false, true},
      {"einsum_cross", With(einsum, [](AttentionDims& d) { d.kdim = 9, d.vdim = 11; }),
       {2, 3}, {3, 1}, false, M::kFloat, M::kBool},
      {"post_norm", norm, {4, 2}, {}, false, M::kBool},
      {"one_head", Dims(8, 1), {3}, {}},
      {"many_heads", Dims(64, 8), {9, 9, 9}, {}, false, M::kBool, M::kFloat},
      // Blocks above the small-attention threshold: the oneDNN products.
      {"large_blocks", Dims(64, 4), {80, 80, 70}, {}, false, M::kBool, M::kFloat, true, false,
       true},
      {"large_blocks_cross", With(cross, [](AttentionDims& d) { d.add_zero_attn = true; }),
       {90}, {120}, false, M::kFloat, M::kNone},
  };
}
// clang-format on

}  // namespace mha::testing
