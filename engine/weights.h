// Finding an attention layer's weights in a safetensors checkpoint, in any of
// the three layouts users train with, and packing them into one form.
#ifndef MHA_ENGINE_WEIGHTS_H_
#define MHA_ENGINE_WEIGHTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "mha/v1/model_config.pb.h"

namespace mha {

enum class WeightLayout {
  kInProj,          // nn.MultiheadAttention: in_proj_weight [3E, E]
  kSeparateProjWeights,  // nn.MultiheadAttention: q/k/v_proj_weight
  kSeparateLinears,      // q_proj.weight, k_proj.weight, v_proj.weight
  kPerHeadLinears,       // q_proj.{i}.weight, one linear per head
};
const char* WeightLayoutName(WeightLayout layout);

// All parameters of one attention layer in f32, `nn.Linear` layout
// ([out_features, in_features] row-major), heads stacked along `out`.
// Absent biases are zeros. Plain value type.
struct PackedWeights {
  WeightLayout layout = WeightLayout::kInProj;
  std::vector<float> w_q, w_k, w_v;  // [h*dqk, E], [h*dqk, kdim], [h*dv, vdim]
  std::vector<float> b_q, b_k, b_v;  // [h*dqk], [h*dqk], [h*dv]
  std::vector<float> w_o, b_o;       // [E, h*dv], [E]
  std::vector<float> bias_k, bias_v;  // [h*dqk], [h*dv] when add_bias_kv
  std::vector<float> norm_weight, norm_bias;  // [E] when post_norm
  int64_t parameter_count = 0;  // as stored in the checkpoint
};

// Detects the layout and packs it. Errors name the tensor (as looked up in
// the file) and the expected shape.
absl::StatusOr<PackedWeights> PackWeights(const AttentionDims& dims,
                                          const v1::ModelConfig& config,
                                          const TensorMap& tensors);

}  // namespace mha

#endif  // MHA_ENGINE_WEIGHTS_H_
