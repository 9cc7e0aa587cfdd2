#include "tests/engine/reference_mha.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mha::testing {
namespace {

// y[r, o] = sum_i x[r, i] w[o, i] + b[o]
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<float>& w, const std::vector<float>& b, int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
      y[r * out + o] = acc;
    }
  }
  return y;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Appends bias_kv and zero_attn rows as PyTorch does.
void AppendExtraKeys(const AttentionDims& d, const PackedWeights& w, std::vector<double>& k,
                     std::vector<double>& v) {
  if (d.add_bias_kv) {
    k.insert(k.end(), w.bias_k.begin(), w.bias_k.end());
    v.insert(v.end(), w.bias_v.begin(), w.bias_v.end());
  }
  if (d.add_zero_attn) {
    k.insert(k.end(), d.qk_width(), 0.0);
    v.insert(v.end(), d.v_width(), 0.0);
  }
}

double MaskAt(const ReferenceSequence& s, int64_t head, int64_t i, int64_t j) {
  if (j >= s.kv_len) return 0.0;  // appended keys are never masked
  double m = 0.0;
  if (!s.key_padding.empty()) m += s.key_padding[j];
  if (!s.attn_mask.empty()) {
    const bool per_head = static_cast<int64_t>(s.attn_mask.size()) > s.q_len * s.kv_len;
    m += s.attn_mask[(per_head ? head * s.q_len * s.kv_len : 0) + i * s.kv_len + j];
  }
  if (s.causal && j > i) m = -std::numeric_limits<double>::infinity();
  return m;
}

}  // namespace

ReferenceResult ReferenceAttention(const AttentionDims& d, const PackedWeights& w,
                                   const ReferenceSequence& s) {
  const int64_t e = d.embed_dim, h = d.num_heads, dk = d.qk_head_dim, dv = d.v_head_dim;
  const int64_t qk = d.qk_width(), vw = d.v_width(), L = s.q_len;
  const std::vector<double> x = ToDouble(s.query);
  const std::vector<double> key = s.key.empty() ? x : ToDouble(s.key);
  const std::vector<double> value = s.key.empty() ? x : ToDouble(s.value.empty() ? s.key : s.value);
  const std::vector<double> q = Linear(x, L, e, w.w_q, w.b_q, qk);
  std::vector<double> k = Linear(key, s.kv_len, d.kdim, w.w_k, w.b_k, qk);
  std::vector<double> v = Linear(value, s.kv_len, d.vdim, w.w_v, w.b_v, vw);
  AppendExtraKeys(d, w, k, v);
  const int64_t S = s.kv_len + d.extra_keys();

  ReferenceResult r;
  r.head_weights.assign(h * L * S, 0.0f);
  std::vector<double> context(L * vw, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t i = 0; i < L; ++i) {
      std::vector<double> score(S);
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        double dot = 0.0;
        for (int64_t c = 0; c < dk; ++c)
          dot += q[i * qk + head * dk + c] * k[j * qk + head * dk + c];
        score[j] = dot * scale + MaskAt(s, head, i, j);
        max = std::max(max, score[j]);
      }
      if (std::isinf(max) && max < 0) continue;  // all masked: zero weights
      double sum = 0.0;
      for (double& sc : score) sum += (sc = std::exp(sc - max));
      for (int64_t j = 0; j < S; ++j) {
        const double p = score[j] / sum;
        r.head_weights[(head * L + i) * S + j] = static_cast<float>(p);
        for (int64_t c = 0; c < dv; ++c)
          context[i * vw + head * dv + c] += p * v[j * vw + head * dv + c];
      }
    }
  }
  std::vector<double> out = Linear(context, L, vw, w.w_o, w.b_o, e);
  if (d.post_norm) {
    for (int64_t i = 0; i < L; ++i) {
      double mean = 0.0, var = 0.0;
      for (int64_t c = 0; c < e; ++c) mean += (out[i * e + c] += x[i * e + c]);
      mean /= e;
      for (int64_t c = 0; c < e; ++c) var += (out[i * e + c] - mean) * (out[i * e + c] - mean);
      const double inv = 1.0 / std::sqrt(var / e + d.norm_eps);
      for (int64_t c = 0; c < e; ++c)
        out[i * e + c] = (out[i * e + c] - mean) * inv * w.norm_weight[c] + w.norm_bias[c];
    }
  }
  r.output.assign(out.begin(), out.end());
  return r;
}

}  // namespace mha::testing
