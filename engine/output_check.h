// A call's f32 output checked finite (and converted to its wire dtype) on
// the calling thread's compute threads: for a worker thread, after its
// engine call, while those threads would otherwise wait.
#ifndef MHA_ENGINE_OUTPUT_CHECK_H_
#define MHA_ENGINE_OUTPUT_CHECK_H_

#include <cstdint>

#include "absl/types/span.h"
#include "engine/dtype.h"

namespace mha {

// Whether every value is finite (FirstNonFinite < 0). From 256 KiB the
// values are shared out across the calling thread's compute threads
// (SetComputeThreads), each checking its own part.
bool AllFiniteAcrossThreads(absl::Span<const float> values);

// ConvertFiniteFromFloat, the values shared out as above, each thread
// converting its own part into the same place of `bytes`: whether every
// value was finite (the bytes are then all written).
bool ConvertFiniteAcrossThreads(absl::Span<const float> values, DType dtype, uint8_t* bytes);

}  // namespace mha

#endif  // MHA_ENGINE_OUTPUT_CHECK_H_
