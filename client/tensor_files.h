// Wire tensors to and from safetensors files, for `mha_client attend`.
#ifndef MHA_CLIENT_TENSOR_FILES_H_
#define MHA_CLIENT_TENSOR_FILES_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mha/v1/attention.pb.h"

namespace mha::client {

// The tensor `name` of a safetensors file, or its only tensor when it has
// no tensor of that name. F32, F16, BF16 and BOOL map to the wire dtypes.
absl::StatusOr<v1::Tensor> ReadWireTensor(const std::string& path, const std::string& name);

// Every tensor of the file is named in `known`, or (when `any_single`) the
// file holds exactly one tensor; else INVALID_ARGUMENT naming the unknown
// tensor and the known names (a misspelt mask must not pass silently).
absl::Status CheckTensorNames(const std::string& path, const std::vector<std::string>& known,
                              bool any_single);

// Whether the file holds a tensor called `name`.
absl::StatusOr<bool> HasTensor(const std::string& path, const std::string& name);

// Writes wire tensors (by name) as one safetensors file.
absl::Status WriteWireTensors(const std::string& path,
                              const std::map<std::string, const v1::Tensor*>& tensors);

// The same values as `dtype` (FP16 or BF16) from FP32; other tensors and
// dtypes are returned as they are.
v1::Tensor ToWireDtype(const v1::Tensor& t, v1::DataType dtype);

}  // namespace mha::client

#endif  // MHA_CLIENT_TENSOR_FILES_H_
