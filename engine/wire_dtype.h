// mha.v1's DataType enum and the engine's DType, mapped through the one
// dtype-name table (engine/tensor.h): shared by the server and the client.
#ifndef MHA_ENGINE_WIRE_DTYPE_H_
#define MHA_ENGINE_WIRE_DTYPE_H_

#include <optional>

#include "engine/tensor.h"
#include "mha/v1/model_config.pb.h"

namespace mha {

// nullopt for DATA_TYPE_UNSPECIFIED and values no DType has.
std::optional<DType> FromWireDType(v1::DataType dtype);
v1::DataType ToWireDType(DType dtype);

}  // namespace mha

#endif  // MHA_ENGINE_WIRE_DTYPE_H_
