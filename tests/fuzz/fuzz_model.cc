// libFuzzer target: a model folder's two files from fuzz bytes: config.pbtxt
// text, a 0xff byte, then weights.safetensors bytes. Config parsing, dims
// validation, weight-layout detection and packing, and engine creation must
// answer with a Status, never crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/model.h"
#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t split = bytes.find('\xff');
  const std::string config_text(bytes.substr(0, split));
  const std::string_view weights = split == std::string_view::npos ? "" : bytes.substr(split + 1);
  absl::StatusOr<mha::v1::ModelConfig> config = mha::ParseModelConfig(config_text);
  if (!config.ok()) return 0;
  absl::StatusOr<mha::AttentionDims> dims = mha::ResolveDims(*config);
  // Keep the engine small: fuzzing is about the checks, not big matrices.
  if (!dims.ok() || dims->embed_dim > 64 || dims->kdim > 64 || dims->vdim > 64 ||
      dims->qk_width() > 64 || dims->v_width() > 64) {
    return 0;
  }
  absl::StatusOr<mha::TensorMap> tensors = mha::ParseSafetensors(weights);
  if (!tensors.ok()) return 0;
  (void)mha::BuildModel(*config, *tensors);
  return 0;
}
