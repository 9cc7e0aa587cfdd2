#include "engine/weights.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace mha {
namespace {

// Resolves canonical names through `tensor_names` and `tensor_prefix`, and
// reads tensors as f32 after checking their shape. Borrows the config and the
// tensors; lives only while packing.
class WeightFinder {
 public:
  WeightFinder(const v1::ModelConfig& config, const TensorMap& tensors)
      : config_(config), tensors_(tensors) {}

  std::string FileName(const std::string& canonical) const {
    auto it = config_.tensor_names().find(canonical);
    if (it != config_.tensor_names().end()) return it->second;
    return config_.tensor_prefix() + canonical;
  }

  bool Has(const std::string& canonical) const { return tensors_.count(FileName(canonical)) > 0; }

  absl::StatusOr<std::vector<float>> Get(const std::string& canonical, std::vector<int64_t> shape) {
    const std::string name = FileName(canonical);
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing tensor '", name, "' (expected shape ", ShapeString(shape), ")"));
    }
    const Tensor& t = it->second;
    if (t.dtype() == DType::kBool) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': dtype BOOL, expected F32, F16 or BF16"));
    }
    if (t.shape() != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': expected shape ",
                                                     ShapeString(shape), ", got ",
                                                     ShapeString(t.shape())));
    }
    parameter_count_ += t.num_elements();
    return ToFloatVector(t);
  }

  // A bias: read when the config has biases, rejected when it has none.
  absl::StatusOr<std::vector<float>> GetBias(const std::string& canonical, int64_t size,
                                             bool enabled) {
    if (enabled) return Get(canonical, {size});
    if (Has(canonical)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", FileName(canonical), "' is present but the config says bias: false"));
    }
    return std::vector<float>(static_cast<size_t>(size), 0.0f);
  }

  int64_t parameter_count() const { return parameter_count_; }

 private:
  const v1::ModelConfig& config_;
  const TensorMap& tensors_;
  int64_t parameter_count_ = 0;
};

void Append(std::vector<float>& to, const std::vector<float>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

absl::StatusOr<WeightLayout> DetectLayout(const WeightFinder& f) {
  if (f.Has("in_proj_weight")) return WeightLayout::kInProj;
  if (f.Has("q_proj_weight")) return WeightLayout::kSeparateProjWeights;
  if (f.Has("q_proj.weight")) return WeightLayout::kSeparateLinears;
  if (f.Has("q_proj.0.weight")) return WeightLayout::kPerHeadLinears;
  return absl::InvalidArgumentError(
      absl::StrCat("no attention weights found: expected '", f.FileName("in_proj_weight"), "', '",
                   f.FileName("q_proj_weight"), "', '", f.FileName("q_proj.weight"), "' or '",
                   f.FileName("q_proj.0.weight"), "'"));
}

// nn.MultiheadAttention's fused in_proj: rows [q; k; v].
absl::Status PackInProj(const AttentionDims& d, WeightFinder& f, PackedWeights& w) {
  const int64_t qk = d.qk_width(), v = d.v_width(), e = d.embed_dim;
  if (d.kdim != e || d.vdim != e) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", f.FileName("in_proj_weight"),
                     "' needs kdim == vdim == embed_dim (", e, "); got kdim ", d.kdim, ", vdim ",
                     d.vdim, " (use q_proj_weight, k_proj_weight, v_proj_weight)"));
  }
  ASSIGN_OR_RETURN(std::vector<float> in_w, f.Get("in_proj_weight", {2 * qk + v, e}));
  w.w_q.assign(in_w.begin(), in_w.begin() + qk * e);
  w.w_k.assign(in_w.begin() + qk * e, in_w.begin() + 2 * qk * e);
  w.w_v.assign(in_w.begin() + 2 * qk * e, in_w.end());
  return absl::OkStatus();
}

absl::Status SplitInProjBias(const AttentionDims& d, WeightFinder& f, PackedWeights& w) {
  const int64_t qk = d.qk_width();
  ASSIGN_OR_RETURN(std::vector<float> b, f.GetBias("in_proj_bias", 2 * qk + d.v_width(), d.bias));
  w.b_q.assign(b.begin(), b.begin() + qk);
  w.b_k.assign(b.begin() + qk, b.begin() + 2 * qk);
  w.b_v.assign(b.begin() + 2 * qk, b.end());
  return absl::OkStatus();
}

absl::Status PackSeparateProjWeights(const AttentionDims& d, WeightFinder& f, PackedWeights& w) {
  ASSIGN_OR_RETURN(w.w_q, f.Get("q_proj_weight", {d.qk_width(), d.embed_dim}));
  ASSIGN_OR_RETURN(w.w_k, f.Get("k_proj_weight", {d.qk_width(), d.kdim}));
  ASSIGN_OR_RETURN(w.w_v, f.Get("v_proj_weight", {d.v_width(), d.vdim}));
  return absl::OkStatus();
}

// One projection ("q", "k" or "v") as `<p>_proj.weight`/`.bias` or, per head,
// `<p>_proj.<i>.weight`/`.bias`, stacked head after head.
absl::Status PackLinear(const AttentionDims& d, WeightFinder& f, bool per_head,
                        const std::string& p, int64_t head_dim, int64_t in_dim,
                        std::vector<float>& weight, std::vector<float>& bias) {
  if (!per_head) {
    ASSIGN_OR_RETURN(weight, f.Get(p + "_proj.weight", {d.num_heads * head_dim, in_dim}));
    ASSIGN_OR_RETURN(bias, f.GetBias(p + "_proj.bias", d.num_heads * head_dim, d.bias));
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < d.num_heads; ++i) {
    const std::string name = absl::StrCat(p, "_proj.", i);
    ASSIGN_OR_RETURN(std::vector<float> wi, f.Get(name + ".weight", {head_dim, in_dim}));
    ASSIGN_OR_RETURN(std::vector<float> bi, f.GetBias(name + ".bias", head_dim, d.bias));
    Append(weight, wi);
    Append(bias, bi);
  }
  return absl::OkStatus();
}

absl::Status PackInputProjections(const AttentionDims& d, WeightFinder& f, PackedWeights& w) {
  switch (w.layout) {
    case WeightLayout::kInProj:
      RETURN_IF_ERROR(PackInProj(d, f, w));
      return SplitInProjBias(d, f, w);
    case WeightLayout::kSeparateProjWeights:
      RETURN_IF_ERROR(PackSeparateProjWeights(d, f, w));
      return SplitInProjBias(d, f, w);
    case WeightLayout::kSeparateLinears:
    case WeightLayout::kPerHeadLinears: {
      const bool per_head = w.layout == WeightLayout::kPerHeadLinears;
      RETURN_IF_ERROR(PackLinear(d, f, per_head, "q", d.qk_head_dim, d.embed_dim, w.w_q, w.b_q));
      RETURN_IF_ERROR(PackLinear(d, f, per_head, "k", d.qk_head_dim, d.kdim, w.w_k, w.b_k));
      return PackLinear(d, f, per_head, "v", d.v_head_dim, d.vdim, w.w_v, w.b_v);
    }
  }
  return absl::InternalError("unknown weight layout");
}

}  // namespace

const char* WeightLayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kInProj:
      return "in_proj";
    case WeightLayout::kSeparateProjWeights:
      return "separate_proj_weights";
    case WeightLayout::kSeparateLinears:
      return "separate_linears";
    case WeightLayout::kPerHeadLinears:
      return "per_head_linears";
  }
  return "unknown";
}

absl::StatusOr<PackedWeights> PackWeights(const AttentionDims& d, const v1::ModelConfig& config,
                                          const TensorMap& tensors) {
  WeightFinder f(config, tensors);
  PackedWeights w;
  ASSIGN_OR_RETURN(w.layout, DetectLayout(f));
  RETURN_IF_ERROR(PackInputProjections(d, f, w));
  ASSIGN_OR_RETURN(w.w_o, f.Get("out_proj.weight", {d.embed_dim, d.v_width()}));
  ASSIGN_OR_RETURN(w.b_o, f.GetBias("out_proj.bias", d.embed_dim, d.bias));
  if (d.add_bias_kv) {
    ASSIGN_OR_RETURN(w.bias_k, f.Get("bias_k", {1, 1, d.qk_width()}));
    ASSIGN_OR_RETURN(w.bias_v, f.Get("bias_v", {1, 1, d.v_width()}));
  }
  if (d.post_norm) {
    ASSIGN_OR_RETURN(w.norm_weight, f.Get("norm.weight", {d.embed_dim}));
    ASSIGN_OR_RETURN(w.norm_bias, f.Get("norm.bias", {d.embed_dim}));
  }
  w.parameter_count = f.parameter_count();
  return w;
}

}  // namespace mha
