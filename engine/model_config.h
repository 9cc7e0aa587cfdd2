// Reading `config.pbtxt` and resolving it into the validated dimensions the
// engine computes with.
#ifndef MHA_ENGINE_MODEL_CONFIG_H_
#define MHA_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/attention_dims.h"
#include "mha/v1/model_config.pb.h"

namespace mha {

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
