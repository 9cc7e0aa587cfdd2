// Prometheus metrics of the server (prometheus-cpp), exposed on /metrics.
#ifndef MHA_SERVER_METRICS_H_
#define MHA_SERVER_METRICS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mha::server {

// The per-model series, created once when the model is registered so the
// hot path never looks up label sets. Pointers into the registry's families;
// prometheus-cpp metrics are thread-safe.
struct ModelMetrics {
  prometheus::Histogram* request_duration = nullptr;
  prometheus::Histogram* queue_duration = nullptr;
  prometheus::Histogram* compute_duration = nullptr;
  prometheus::Histogram* batch_requests = nullptr;
  prometheus::Histogram* batch_tokens = nullptr;
  prometheus::Gauge* queue_depth = nullptr;
  prometheus::Gauge* inflight = nullptr;
  prometheus::Counter* tokens = nullptr;
  prometheus::Gauge* loaded = nullptr;
  prometheus::Counter* primitive_cache_misses = nullptr;
};

// Owns the registry and every metric family. Thread-safe.
class Metrics {
 public:
  Metrics();

  // Series for `model` (label value as given; unknown names are not passed
  // here, so clients cannot blow up the label cardinality).
  ModelMetrics& ForModel(const std::string& model);
  // One answered attention call; `api` is kApiMha or kApiKserve.
  void CountRequest(const std::string& model, const char* api, absl::StatusCode code);
  void CountDropped(const std::string& model, const std::string& reason);
  // A model version (or its folder) that failed to load or reload.
  void CountLoadFailure(const std::string& model);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  prometheus::Gauge& memory_limit() { return memory_; }
  prometheus::Gauge& memory_reserved() { return memory_reserved_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Family<prometheus::Histogram>& queue_duration_;
  prometheus::Family<prometheus::Histogram>& compute_duration_;
  prometheus::Family<prometheus::Histogram>& batch_requests_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Gauge>& inflight_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Family<prometheus::Gauge>& loaded_;
  prometheus::Family<prometheus::Counter>& load_failures_;
  prometheus::Family<prometheus::Counter>& primitive_cache_misses_;
  prometheus::Gauge& memory_;
  prometheus::Gauge& memory_reserved_;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>> models_;
};

// Values of the `api` label of mha_requests_total: which front end answered.
inline constexpr char kApiMha[] = "mha.v1";
inline constexpr char kApiKserve[] = "kserve.v2";

// The reasons of mha_dropped_requests_total, each exported from the start.
inline constexpr const char* kDropReasons[] = {"deadline", "cancelled", "queue_full", "memory",
                                               "message_size"};

// The label value used for requests naming no loaded model.
inline constexpr char kUnknownModelLabel[] = "_unknown";

// "OK", "INVALID_ARGUMENT", ...: the gRPC code names used as label values.
std::string CodeLabel(absl::StatusCode code);

}  // namespace mha::server

#endif  // MHA_SERVER_METRICS_H_
