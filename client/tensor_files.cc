#include "client/tensor_files.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_common.h"
#include "engine/safetensors.h"
#include "engine/wire_dtype.h"

namespace mha::client {

absl::StatusOr<v1::Tensor> ReadWireTensor(const std::string& path, const std::string& name) {
  absl::StatusOr<TensorMap> tensors = ReadSafetensors(path);
  if (!tensors.ok()) return tensors.status();
  auto it = tensors->find(name);
  if (it == tensors->end()) {
    if (tensors->size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": no tensor '", name, "' (and not exactly one tensor to take instead)"));
    }
    it = tensors->begin();
  }
  const Tensor& t = it->second;
  v1::Tensor wire;
  wire.set_dtype(ToWireDType(t.dtype()));
  wire.mutable_shape()->Assign(t.shape().begin(), t.shape().end());
  wire.set_data(std::string(reinterpret_cast<const char*>(t.raw()), t.num_bytes()));
  return wire;
}

absl::Status CheckTensorNames(const std::string& path, const std::vector<std::string>& known,
                              bool any_single) {
  absl::StatusOr<TensorMap> tensors = ReadSafetensors(path);
  if (!tensors.ok()) return tensors.status();
  if (any_single && tensors->size() == 1) return absl::OkStatus();
  for (const auto& [name, tensor] : *tensors) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown tensor '", name,
                       "'; the names it may hold: ", absl::StrJoin(known, ", ")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> HasTensor(const std::string& path, const std::string& name) {
  absl::StatusOr<TensorMap> tensors = ReadSafetensors(path);
  if (!tensors.ok()) return tensors.status();
  return tensors->count(name) > 0;
}

absl::Status WriteWireTensors(const std::string& path,
                              const std::map<std::string, const v1::Tensor*>& tensors) {
  TensorMap out;
  for (const auto& [name, wire] : tensors) {
    const std::optional<DType> dtype = FromWireDType(wire->dtype());
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": cannot store dtype ", v1::DataType_Name(wire->dtype())));
    }
    Tensor t(*dtype, std::vector<int64_t>(wire->shape().begin(), wire->shape().end()));
    if (t.num_bytes() != wire->data().size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": data does not match its shape"));
    }
    if (t.num_bytes() > 0) std::memcpy(t.raw(), wire->data().data(), t.num_bytes());
    out.emplace(name, std::move(t));
  }
  return WriteSafetensors(path, out);
}

v1::Tensor ToWireDtype(const v1::Tensor& t, v1::DataType dtype) {
  if (t.dtype() != v1::DATA_TYPE_FP32) return t;
  if (dtype != v1::DATA_TYPE_BF16 && dtype != v1::DATA_TYPE_FP16) return t;
  v1::Tensor out = t;
  out.set_dtype(dtype);
  const std::vector<float> values = TensorValues(t);
  std::string data(values.size() * 2, '\0');
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()),
                   dtype == v1::DATA_TYPE_BF16 ? DType::kBF16 : DType::kF16,
                   reinterpret_cast<uint8_t*>(data.data()));
  out.set_data(std::move(data));
  return out;
}

}  // namespace mha::client
