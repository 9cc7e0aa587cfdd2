// libFuzzer target: the safetensors parser on arbitrary bytes. Every input
// must give a TensorMap or a Status; the sanitizers catch anything else.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::StatusOr<mha::TensorMap> tensors =
      mha::ParseSafetensors(std::string_view(reinterpret_cast<const char*>(data), size));
  if (tensors.ok()) {
    // What parsed must serialise and parse back to the same tensors.
    const std::string again = mha::SerializeSafetensors(*tensors);
    const absl::StatusOr<mha::TensorMap> round_trip = mha::ParseSafetensors(again);
    if (!round_trip.ok() || round_trip->size() != tensors->size()) __builtin_trap();
  }
  return 0;
}
