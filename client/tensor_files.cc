#include "client/tensor_files.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/safetensors.h"

namespace mha::client {
namespace {

v1::DataType WireDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::DATA_TYPE_FP32;
    case DType::kF16:
      return v1::DATA_TYPE_FP16;
    case DType::kBF16:
      return v1::DATA_TYPE_BF16;
    case DType::kBool:
      return v1::DATA_TYPE_BOOL;
  }
  return v1::DATA_TYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FileDType(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FP32:
      return DType::kF32;
    case v1::DATA_TYPE_FP16:
      return DType::kF16;
    case v1::DATA_TYPE_BF16:
      return DType::kBF16;
    case v1::DATA_TYPE_BOOL:
      return DType::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot store dtype ", v1::DataType_Name(dtype)));
  }
}

}  // namespace

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
  wire.set_dtype(WireDType(t.dtype()));
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
      return absl::InvalidArgumentError(absl::StrCat(path, ": unknown tensor '", name,
                                                     "'; the names it may hold: ",
                                                     absl::StrJoin(known, ", ")));
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
    absl::StatusOr<DType> dtype = FileDType(wire->dtype());
    if (!dtype.ok()) return dtype.status();
    Tensor t(*dtype, std::vector<int64_t>(wire->shape().begin(), wire->shape().end()));
    if (t.num_bytes() != wire->data().size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": data does not match its shape"));
    }
    if (t.num_bytes() > 0) std::memcpy(t.raw(), wire->data().data(), t.num_bytes());
    out.emplace(name, std::move(t));
  }
  return WriteSafetensors(path, out);
}

v1::Tensor ToBf16(const v1::Tensor& t) {
  if (t.dtype() != v1::DATA_TYPE_FP32) return t;
  v1::Tensor out = t;
  out.set_dtype(v1::DATA_TYPE_BF16);
  const size_t n = t.data().size() / 4;
  std::string data(n * 2, '\0');
  for (size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, t.data().data() + 4 * i, 4);
    const uint16_t b = FloatToBf16(f);
    std::memcpy(data.data() + 2 * i, &b, 2);
  }
  out.set_data(std::move(data));
  return out;
}

}  // namespace mha::client
