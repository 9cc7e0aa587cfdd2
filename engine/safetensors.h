// Reading and writing the safetensors format: an 8-byte little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets}}, raw data.
#ifndef MHA_ENGINE_SAFETENSORS_H_
#define MHA_ENGINE_SAFETENSORS_H_

#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tensor.h"

namespace mha {

using TensorMap = std::map<std::string, Tensor>;

// Largest header accepted; real headers are a few KiB.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100u << 20;

// Parses a whole safetensors file held in memory. Accepts F32, F16, BF16 and
// BOOL tensors. Every inconsistency (truncation, a header length beyond the
// file, offsets out of range, overlapping or not matching dtype x shape,
// unknown dtype, malformed JSON) is an INVALID_ARGUMENT naming the tensor.
absl::StatusOr<TensorMap> ParseSafetensors(std::string_view bytes);

// Reads and parses `path`.
absl::StatusOr<TensorMap> ReadSafetensors(const std::string& path);

// Serialises tensors (sorted by name, packed back to back).
std::string SerializeSafetensors(const TensorMap& tensors);
absl::Status WriteSafetensors(const std::string& path, const TensorMap& tensors);

}  // namespace mha

#endif  // MHA_ENGINE_SAFETENSORS_H_
