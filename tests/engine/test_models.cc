#include "tests/engine/test_models.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace mha::testing {
namespace {

Tensor Named(std::vector<int64_t> shape, const float* data) {
  Tensor t(DType::kF32, std::move(shape));
  std::copy(data, data + t.num_elements(), t.f32());
  return t;
}

// Rows [row0, row0 + rows) of a [*, cols] matrix as a tensor.
Tensor Rows(const std::vector<float>& m, int64_t row0, int64_t rows, int64_t cols) {
  return Named({rows, cols}, m.data() + row0 * cols);
}

void AddProjection(TensorMap& t, const std::string& prefix, const AttentionDims& d, bool per_head,
                   const std::string& p, const std::vector<float>& w, const std::vector<float>& b,
                   int64_t head_dim, int64_t in_dim) {
  if (!per_head) {
    t[prefix + p + "_proj.weight"] = Rows(w, 0, d.num_heads * head_dim, in_dim);
    if (d.bias) t[prefix + p + "_proj.bias"] = Named({d.num_heads * head_dim}, b.data());
    return;
  }
  for (int64_t i = 0; i < d.num_heads; ++i) {
    const std::string name = absl::StrCat(prefix, p, "_proj.", i);
    t[name + ".weight"] = Rows(w, i * head_dim, head_dim, in_dim);
    if (d.bias) t[name + ".bias"] = Named({head_dim}, b.data() + i * head_dim);
  }
}

}  // namespace

AttentionDims MakeDims(int64_t embed_dim, int64_t num_heads) {
  AttentionDims d;
  d.embed_dim = d.kdim = d.vdim = embed_dim;
  d.num_heads = num_heads;
  d.qk_head_dim = d.v_head_dim = embed_dim / num_heads;
  return d;
}

std::vector<float> RandomVector(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

v1::ModelConfig ConfigFor(const AttentionDims& d) {
  v1::ModelConfig c;
  c.set_embed_dim(d.embed_dim);
  c.set_num_heads(d.num_heads);
  c.set_kdim(d.kdim);
  c.set_vdim(d.vdim);
  c.set_qk_head_dim(d.qk_head_dim);
  c.set_v_head_dim(d.v_head_dim);
  c.set_bias(d.bias);
  c.set_add_bias_kv(d.add_bias_kv);
  c.set_add_zero_attn(d.add_zero_attn);
  c.set_compute_dtype(d.int8   ? v1::DATA_TYPE_INT8
                      : d.bf16 ? v1::DATA_TYPE_BF16
                               : v1::DATA_TYPE_FP32);
  if (d.post_norm) c.mutable_post_norm()->set_eps(d.norm_eps);
  return c;
}

PackedWeights RandomWeights(const AttentionDims& d, uint32_t seed) {
  const int64_t e = d.embed_dim, qk = d.qk_width(), v = d.v_width();
  auto weight = [&](int64_t out, int64_t in, uint32_t salt) {
    return RandomVector(out * in, seed * 131 + salt, 1.0f / std::sqrt(float(in)));
  };
  auto bias = [&](int64_t n, uint32_t salt) {
    return d.bias ? RandomVector(n, seed * 131 + salt, 0.2f) : std::vector<float>(n, 0.0f);
  };
  PackedWeights w;
  w.w_q = weight(qk, e, 1), w.w_k = weight(qk, d.kdim, 2), w.w_v = weight(v, d.vdim, 3);
  w.b_q = bias(qk, 4), w.b_k = bias(qk, 5), w.b_v = bias(v, 6);
  w.w_o = weight(e, v, 7), w.b_o = bias(e, 8);
  if (d.add_bias_kv) {
    w.bias_k = RandomVector(qk, seed * 131 + 9);
    w.bias_v = RandomVector(v, seed * 131 + 10);
  }
  if (d.post_norm) {
    w.norm_weight = RandomVector(e, seed * 131 + 11, 0.5f);
    for (float& x : w.norm_weight) x += 1.0f;
    w.norm_bias = RandomVector(e, seed * 131 + 12, 0.3f);
  }
  return w;
}

TensorMap WeightsAsTensors(const AttentionDims& d, const PackedWeights& w, WeightLayout layout,
                           const std::string& prefix) {
  TensorMap t;
  const int64_t e = d.embed_dim, qk = d.qk_width(), v = d.v_width();
  switch (layout) {
    case WeightLayout::kInProj:
    case WeightLayout::kSeparateProjWeights: {
      if (layout == WeightLayout::kInProj) {
        std::vector<float> in_w = w.w_q;
        in_w.insert(in_w.end(), w.w_k.begin(), w.w_k.end());
        in_w.insert(in_w.end(), w.w_v.begin(), w.w_v.end());
        t[prefix + "in_proj_weight"] = Named({2 * qk + v, e}, in_w.data());
      } else {
        t[prefix + "q_proj_weight"] = Named({qk, e}, w.w_q.data());
        t[prefix + "k_proj_weight"] = Named({qk, d.kdim}, w.w_k.data());
        t[prefix + "v_proj_weight"] = Named({v, d.vdim}, w.w_v.data());
      }
      if (d.bias) {
        std::vector<float> in_b = w.b_q;
        in_b.insert(in_b.end(), w.b_k.begin(), w.b_k.end());
        in_b.insert(in_b.end(), w.b_v.begin(), w.b_v.end());
        t[prefix + "in_proj_bias"] = Named({2 * qk + v}, in_b.data());
      }
      break;
    }
    case WeightLayout::kSeparateLinears:
    case WeightLayout::kPerHeadLinears: {
      const bool per_head = layout == WeightLayout::kPerHeadLinears;
      AddProjection(t, prefix, d, per_head, "q", w.w_q, w.b_q, d.qk_head_dim, e);
      AddProjection(t, prefix, d, per_head, "k", w.w_k, w.b_k, d.qk_head_dim, d.kdim);
      AddProjection(t, prefix, d, per_head, "v", w.w_v, w.b_v, d.v_head_dim, d.vdim);
      break;
    }
  }
  t[prefix + "out_proj.weight"] = Named({e, v}, w.w_o.data());
  if (d.bias) t[prefix + "out_proj.bias"] = Named({e}, w.b_o.data());
  if (d.add_bias_kv) {
    t[prefix + "bias_k"] = Named({1, 1, qk}, w.bias_k.data());
    t[prefix + "bias_v"] = Named({1, 1, v}, w.bias_v.data());
  }
  if (d.post_norm) {
    t[prefix + "norm.weight"] = Named({e}, w.norm_weight.data());
    t[prefix + "norm.bias"] = Named({e}, w.norm_bias.data());
  }
  return t;
}

void RunSelf(const MhaEngine& engine, int64_t len) {
  const int64_t e = engine.dims().embed_dim;
  const std::vector<float> query = RandomVector(len * e, 7);
  std::vector<float> output(len * e);
  AttentionBatch batch;
  batch.query = query;
  batch.q_offsets = {0, len};
  batch.kv_offsets = {0, 0};
  auto ws = engine.NewWorkspace();
  ASSERT_TRUE(engine.Run(batch, {absl::MakeSpan(output), {}, false}, *ws).ok());
}

}  // namespace mha::testing
