// mha_memory_held_bytes{kind}: what the server holds, read at each scrape of
// /metrics. The kinds the server keeps on purpose (each counted in the
// memory budget: docs/RELIABILITY.md, "Memory"), the free memory glibc's
// arenas hold, and the rest of the resident set.
#ifndef MHA_SERVER_OBSERVABILITY_MEMORY_HELD_H_
#define MHA_SERVER_OBSERVABILITY_MEMORY_HELD_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace mha::server {

// One kind of memory and how to read its bytes now (thread-safe, cheap).
struct HeldKind {
  std::string kind;
  std::function<int64_t()> bytes;
  bool part_of_resident = true;  // false: not subtracted from the rest
};

// Owns the kinds' readers. Collect reads each, and the resident set, and
// adds kind="rest": the resident set less the kinds that are part of it
// (at least 0). Thread-safe when the readers are.
class MemoryHeldCollector : public prometheus::Collectable {
 public:
  MemoryHeldCollector(std::vector<HeldKind> kinds, std::function<int64_t()> resident);
  std::vector<prometheus::MetricFamily> Collect() const override;
  // The sum of the kinds that are part of the resident set.
  int64_t HeldOnPurpose() const;

 private:
  const std::vector<HeldKind> kinds_;
  const std::function<int64_t()> resident_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_OBSERVABILITY_MEMORY_HELD_H_
