#include "engine/wire_dtype.h"

namespace mha {

std::optional<DType> FromWireDType(v1::DataType dtype) {
  if (!v1::DataType_IsValid(dtype)) return std::nullopt;
  return ParseDType(v1::DataType_Name(dtype), DTypeSpelling::kMhaV1);
}

v1::DataType ToWireDType(DType dtype) {
  v1::DataType wire = v1::DATA_TYPE_UNSPECIFIED;
  v1::DataType_Parse(DTypeName(dtype, DTypeSpelling::kMhaV1), &wire);
  return wire;
}

}  // namespace mha
