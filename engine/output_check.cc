#include "engine/output_check.h"

#include <algorithm>
#include <atomic>

#include "engine/ops/parallel_for.h"
#include "engine/tensor.h"

namespace mha {
namespace {

// From this many values a check is shared out: 256 KiB of f32 take ~10 us
// to read, a fork/join ~1 us.
constexpr size_t kSharedMinValues = size_t{64} << 10;

// body(begin, end) for the values' parts, one per compute thread, in
// parallel from kSharedMinValues (a part starts at a multiple of 16
// values); whether every part's body returned true.
template <typename Body>
bool AllParts(size_t n, Body&& body) {
  const int64_t parts = n >= kSharedMinValues ? std::max(1, omp_get_max_threads()) : 1;
  const size_t step = (n / parts + 15) / 16 * 16;
  std::atomic<bool> all{true};
  ForRange(parts, parts > 1, [&](int64_t i) {
    const size_t begin = std::min(n, i * step);
    const size_t end = i == parts - 1 ? n : std::min(n, begin + step);
    if (!body(begin, end)) {
      all.store(false, std::memory_order_relaxed);
    }
  });
  return all.load();
}

}  // namespace

bool AllFiniteAcrossThreads(absl::Span<const float> values) {
  return AllParts(values.size(), [&](size_t begin, size_t end) {
    return FirstNonFinite(values.subspan(begin, end - begin)) < 0;
  });
}

bool ConvertFiniteAcrossThreads(absl::Span<const float> values, DType dtype, uint8_t* bytes) {
  const size_t size = DTypeSize(dtype);
  return AllParts(values.size(), [&](size_t begin, size_t end) {
    return ConvertFiniteFromFloat(values.subspan(begin, end - begin), dtype, bytes + begin * size);
  });
}

}  // namespace mha
