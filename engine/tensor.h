// Host tensors: the one table of dtype names (each format's spelling), an
// owning row-major tensor, shapes. The element types and their conversions
// are engine/dtype.h (the compute path's part).
#ifndef MHA_ENGINE_TENSOR_H_
#define MHA_ENGINE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/dtype.h"

namespace mha {

// The one table of dtype names, in each format's spelling: safetensors
// ("F32", "F16", "BF16", "BOOL"), KServe v2 ("FP32", "FP16", "BF16",
// "BOOL") and mha.v1 ("DATA_TYPE_FP32", ...).
enum class DTypeSpelling { kSafetensors, kKserve, kMhaV1 };
const char* DTypeName(DType dtype, DTypeSpelling spelling = DTypeSpelling::kSafetensors);
// The dtype `name` spells, or nullopt.
std::optional<DType> ParseDType(std::string_view name, DTypeSpelling spelling);

// Number of elements of `shape`, or INVALID_ARGUMENT when a dimension is
// negative or the product overflows int64.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape);

// "[2, 3, 4]".
std::string ShapeString(absl::Span<const int64_t> shape);

// A row-major tensor that owns its bytes. Plain value type: copyable,
// movable, not synchronised (thread-compatible).
class Tensor {
 public:
  Tensor() = default;
  // Zero-filled tensor; the shape must already be validated.
  Tensor(DType dtype, std::vector<int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t num_elements() const;
  size_t num_bytes() const { return bytes_.size(); }

  const uint8_t* raw() const { return bytes_.data(); }
  uint8_t* raw() { return bytes_.data(); }
  // Typed views; the caller checks dtype() first.
  const float* f32() const { return reinterpret_cast<const float*>(raw()); }
  float* f32() { return reinterpret_cast<float*>(raw()); }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::vector<uint8_t> bytes_;
};

// The values of a F32, F16 or BF16 tensor as f32 (BOOL: 0/1).
std::vector<float> ToFloatVector(const Tensor& t);

// Index of the first NaN or infinite value, or -1 when all are finite.
int64_t FirstNonFinite(absl::Span<const float> values);

// ConvertFromFloat of `values` into `bytes` (their size in `dtype`) with
// FirstNonFinite's check in the same pass: whether every value was finite
// (it stops at the first chunk that is not). Finite values beyond FP16's
// range still become +-inf, as ConvertFromFloat makes them.
bool ConvertFiniteFromFloat(absl::Span<const float> values, DType dtype, uint8_t* bytes);

// A F32 tensor holding `values` with `shape` (sizes must agree).
Tensor MakeF32Tensor(std::vector<int64_t> shape, absl::Span<const float> values);

}  // namespace mha

#endif  // MHA_ENGINE_TENSOR_H_
