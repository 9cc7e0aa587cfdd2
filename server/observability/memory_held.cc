#include "server/observability/memory_held.h"

#include <algorithm>
#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace mha::server {

MemoryHeldCollector::MemoryHeldCollector(std::vector<HeldKind> kinds,
                                         std::function<int64_t()> resident)
    : kinds_(std::move(kinds)), resident_(std::move(resident)) {}

int64_t MemoryHeldCollector::HeldOnPurpose() const {
  int64_t held = 0;
  for (const HeldKind& k : kinds_) {
    if (k.part_of_resident) held += k.bytes();
  }
  return held;
}

std::vector<prometheus::MetricFamily> MemoryHeldCollector::Collect() const {
  prometheus::MetricFamily family;
  family.name = "mha_memory_held_bytes";
  family.help =
      "Memory the server holds, by kind: weights (the packed weights of every version), "
      "workspaces (the workers'), kept_buffers (large buffers kept for reuse), kv_cache "
      "(session cache blocks), session_answers (the answers kept for a step sent again), "
      "primitives (the oneDNN primitives cached for the models' shapes, at 112 KiB each), "
      "heap_free (free bytes the heap holds: TCMalloc's caches and free spans, resident; "
      "with glibc's malloc, its arenas' free bytes, resident or not), rest (the resident set "
      "less the others but heap_free)";
  family.type = prometheus::MetricType::Gauge;
  auto add = [&family](const std::string& kind, int64_t bytes) {
    prometheus::ClientMetric metric;
    metric.label.push_back({"kind", kind});
    metric.gauge.value = static_cast<double>(bytes);
    family.metric.push_back(std::move(metric));
  };
  int64_t counted = 0;
  for (const HeldKind& k : kinds_) {
    const int64_t bytes = k.bytes();
    add(k.kind, bytes);
    if (k.part_of_resident) counted += bytes;
  }
  add("rest", std::max<int64_t>(0, resident_() - counted));
  return {std::move(family)};
}

}  // namespace mha::server
