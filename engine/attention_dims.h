// The dimensions of one attention layer, as the engine computes with them:
// no protobuf, so that code that only needs the shapes does not see the
// config format.
#ifndef MHA_ENGINE_ATTENTION_DIMS_H_
#define MHA_ENGINE_ATTENTION_DIMS_H_

#include <cmath>
#include <cstdint>

namespace mha {

// The attention layer's shape after defaults are applied. Plain value type.
struct AttentionDims {
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t kdim = 0;
  int64_t vdim = 0;
  int64_t qk_head_dim = 0;
  int64_t v_head_dim = 0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  // The attention core (scores, softmax, weighted sums) and the
  // activations between the products in bf16.
  bool bf16 = false;
  // The four projections in int8 (W8A8: LinearPrecision::kInt8), whatever
  // the core computes in (compute_dtype DATA_TYPE_INT8).
  bool int8 = false;
  // Session caches in bf16 whatever the compute type (half the bytes of an
  // fp32 model's cache; keys and values rounded to bf16 as they are
  // written). A bf16 model's caches are bf16 anyway.
  bool kv_cache_bf16 = false;
  // Session caches in int8 with an f32 scale per token and head (a quarter
  // of an fp32 model's bytes, plus the scales), for either compute type.
  bool kv_cache_int8 = false;
  bool post_norm = false;
  float norm_eps = 1e-5f;

  int64_t qk_width() const { return num_heads * qk_head_dim; }
  int64_t v_width() const { return num_heads * v_head_dim; }
  // What QK^T is scaled by: 1 / sqrt(qk_head_dim).
  float score_scale() const { return 1.0f / std::sqrt(static_cast<float>(qk_head_dim)); }
  // Extra key positions appended to every sequence (bias_kv, zero_attn).
  int64_t extra_keys() const { return (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0); }
  // Bytes of one cached key or value element.
  int64_t kv_elem_bytes() const {
    if (kv_cache_int8) return 1;
    return bf16 || kv_cache_bf16 ? 2 : 4;
  }
};

// Largest width accepted for any dimension; bounds memory a config can ask for.
inline constexpr int64_t kMaxModelDim = 65536;

}  // namespace mha

#endif  // MHA_ENGINE_ATTENTION_DIMS_H_
