#include "engine/model.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace mha {

absl::StatusOr<LoadedModel> BuildModel(const v1::ModelConfig& config, const TensorMap& tensors) {
  LoadedModel model;
  model.config = config;
  ASSIGN_OR_RETURN(model.dims, ResolveDims(config));
  ASSIGN_OR_RETURN(PackedWeights weights, PackWeights(model.dims, config, tensors));
  model.layout = weights.layout;
  model.parameter_count = weights.parameter_count;
  ASSIGN_OR_RETURN(model.engine, MhaEngine::Create(model.dims, weights));
  RETURN_IF_ERROR(model.engine->WarmUp(config.warmup_lengths()));
  return model;
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& dir) {
  ASSIGN_OR_RETURN(v1::ModelConfig config,
                   ReadModelConfig(absl::StrCat(dir, "/", kConfigFileName)));
  // A bad config is reported before a (possibly large) weights file is read.
  const absl::Status config_status = ResolveDims(config).status();
  if (!config_status.ok()) {
    return absl::Status(config_status.code(),
                        absl::StrCat(dir, "/", kConfigFileName, ": ", config_status.message()));
  }
  return LoadModelVersion(config, absl::StrCat(dir, "/", kWeightsFileName));
}

absl::StatusOr<LoadedModel> LoadModelVersion(const v1::ModelConfig& config,
                                             const std::string& weights_path) {
  ASSIGN_OR_RETURN(TensorMap tensors, ReadSafetensors(weights_path));
  absl::StatusOr<LoadedModel> model = BuildModel(config, tensors);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat(weights_path, ": ", model.status().message()));
  }
  return model;
}

}  // namespace mha
