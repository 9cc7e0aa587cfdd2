// A model folder (`config.pbtxt` + `weights.safetensors`) loaded into an
// engine.
#ifndef MHA_ENGINE_MODEL_H_
#define MHA_ENGINE_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/mha_engine.h"
#include "engine/model_config.h"
#include "engine/weights.h"
#include "mha/v1/model_config.pb.h"

namespace mha {

// Everything known about one loaded model. Owns the engine; immutable and
// thread-safe once loaded (see MhaEngine).
struct LoadedModel {
  v1::ModelConfig config;
  AttentionDims dims;
  WeightLayout layout = WeightLayout::kInProj;
  int64_t parameter_count = 0;
  std::unique_ptr<MhaEngine> engine;
};

inline constexpr char kConfigFileName[] = "config.pbtxt";
inline constexpr char kWeightsFileName[] = "weights.safetensors";

// Reads, validates and packs the folder `dir`. Errors name the file and,
// for weights, the tensor.
absl::StatusOr<LoadedModel> LoadModel(const std::string& dir);

// One version of a versioned model folder: the model's config (already
// read and checked) and the version's weights file. Errors name the file.
absl::StatusOr<LoadedModel> LoadModelVersion(const v1::ModelConfig& config,
                                             const std::string& weights_path);

// The same from a config already parsed and tensors already read.
absl::StatusOr<LoadedModel> BuildModel(const v1::ModelConfig& config, const TensorMap& tensors);

}  // namespace mha

#endif  // MHA_ENGINE_MODEL_H_
