// Reading `config.pbtxt` and resolving it into the validated dimensions the
// engine computes with.
#ifndef MHA_ENGINE_MODEL_CONFIG_H_
#define MHA_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "mha/v1/model_config.pb.h"

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
  bool bf16 = false;
  bool post_norm = false;
  float norm_eps = 1e-5f;

  int64_t qk_width() const { return num_heads * qk_head_dim; }
  int64_t v_width() const { return num_heads * v_head_dim; }
  // Extra key positions appended to every sequence (bias_kv, zero_attn).
  int64_t extra_keys() const { return (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0); }
};

// Largest width accepted for any dimension; bounds memory a config can ask for.
inline constexpr int64_t kMaxModelDim = 65536;
// ModelConfig.warmup_lengths: how many, and the longest (load time stays short).
inline constexpr int kMaxWarmupLengths = 16;
inline constexpr int64_t kMaxWarmupLength = 4096;

// Parses protobuf text format; errors name the line and column.
absl::StatusOr<v1::ModelConfig> ParseModelConfig(const std::string& text);
absl::StatusOr<v1::ModelConfig> ReadModelConfig(const std::string& path);

// Applies defaults and validates; INVALID_ARGUMENT names the field.
absl::StatusOr<AttentionDims> ResolveDims(const v1::ModelConfig& config);

}  // namespace mha

#endif  // MHA_ENGINE_MODEL_CONFIG_H_
