// An attention layer's parameters in the one form the engine packs from,
// whatever layout the checkpoint had (engine/weights.h finds and packs them).
#ifndef MHA_ENGINE_PACKED_WEIGHTS_H_
#define MHA_ENGINE_PACKED_WEIGHTS_H_

#include <cstdint>
#include <vector>

namespace mha {

enum class WeightLayout {
  kInProj,               // nn.MultiheadAttention: in_proj_weight [3E, E]
  kSeparateProjWeights,  // nn.MultiheadAttention: q/k/v_proj_weight
  kSeparateLinears,      // q_proj.weight, k_proj.weight, v_proj.weight
  kPerHeadLinears,       // q_proj.{i}.weight, one linear per head
};

// All parameters of one attention layer in f32, `nn.Linear` layout
// ([out_features, in_features] row-major), heads stacked along `out`.
// Absent biases are zeros. Plain value type.
struct PackedWeights {
  WeightLayout layout = WeightLayout::kInProj;
  std::vector<float> w_q, w_k, w_v;           // [h*dqk, E], [h*dqk, kdim], [h*dv, vdim]
  std::vector<float> b_q, b_k, b_v;           // [h*dqk], [h*dqk], [h*dv]
  std::vector<float> w_o, b_o;                // [E, h*dv], [E]
  std::vector<float> bias_k, bias_v;          // [h*dqk], [h*dv] when add_bias_kv
  std::vector<float> norm_weight, norm_bias;  // [E] when post_norm
  int64_t parameter_count = 0;                // as stored in the checkpoint
};

}  // namespace mha

#endif  // MHA_ENGINE_PACKED_WEIGHTS_H_
