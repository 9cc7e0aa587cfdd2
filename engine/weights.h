// Finding an attention layer's weights in a safetensors checkpoint, in any of
// the three layouts users train with, and packing them into one form.
#ifndef MHA_ENGINE_WEIGHTS_H_
#define MHA_ENGINE_WEIGHTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"
#include "engine/packed_weights.h"
#include "engine/safetensors.h"
#include "mha/v1/model_config.pb.h"

namespace mha {

const char* WeightLayoutName(WeightLayout layout);

// Detects the layout and packs it. Errors name the tensor (as looked up in
// the file) and the expected shape.
absl::StatusOr<PackedWeights> PackWeights(const AttentionDims& dims, const v1::ModelConfig& config,
                                          const TensorMap& tensors);

}  // namespace mha

#endif  // MHA_ENGINE_WEIGHTS_H_
