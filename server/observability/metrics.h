// Prometheus metrics of the server (prometheus-cpp), exposed on /metrics.
#ifndef MHA_SERVER_OBSERVABILITY_METRICS_H_
#define MHA_SERVER_OBSERVABILITY_METRICS_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "engine/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mha::server {

// The series of one model version (labels `model`, `version`; version ""
// for what a model counts outside any version, e.g. requests naming a
// version it does not serve), created once so the hot path never looks up
// label sets. Pointers into the registry's families; prometheus-cpp metrics
// are thread-safe, and so is CountRequest.
struct ModelMetrics {
  std::string model, version;
  prometheus::Histogram* request_duration = nullptr;
  prometheus::Histogram* queue_duration = nullptr;
  prometheus::Histogram* compute_duration = nullptr;
  prometheus::Histogram* batch_requests = nullptr;
  prometheus::Histogram* batch_tokens = nullptr;
  prometheus::Gauge* queue_depth = nullptr;
  prometheus::Gauge* inflight = nullptr;
  prometheus::Counter* tokens = nullptr;
  prometheus::Counter* primitive_cache_misses = nullptr;
  prometheus::Counter* split_requests = nullptr;
  prometheus::Counter* yielded_step_calls = nullptr;    // steps run inside a long call
  std::map<std::string, prometheus::Counter*> dropped;  // every kDropReasons entry

  // One answered attention call; `api` is kApiMha, kApiKserve or kApiKserveHttp.
  void CountRequest(const char* api, absl::StatusCode code);
  void CountDropped(const std::string& reason) const { dropped.at(reason)->Increment(); }

  // Set by Metrics: the requests_total family and the series made in it.
  prometheus::Family<prometheus::Counter>* requests_family = nullptr;
  Mutex requests_mu;
  std::map<std::pair<std::string, int>, prometheus::Counter*> requests ABSL_GUARDED_BY(requests_mu);
};

// The sessions' families and series (pointers into the registry; labels
// added as models appear). prometheus-cpp metrics are thread-safe.
struct SessionMetrics {
  prometheus::Family<prometheus::Gauge>* active = nullptr;       // {model}
  prometheus::Family<prometheus::Counter>* evictions = nullptr;  // {model, reason}
  prometheus::Gauge* cache_bytes = nullptr;
  prometheus::Counter* append_tokens = nullptr;
  prometheus::Histogram* append_duration = nullptr;
  prometheus::Histogram* append_queue_duration = nullptr;  // queued to taken into a call
  // The same waits by whether every worker was in a call when the step was
  // queued ({workers="all_busy"}) or not ({workers="some_free"}).
  prometheus::Histogram* append_queue_all_busy = nullptr;
  prometheus::Histogram* append_queue_some_free = nullptr;
  prometheus::Family<prometheus::Counter>* steps_dropped = nullptr;  // {model, reason}
};

// Owns the registry and every metric family. Thread-safe.
class Metrics {
 public:
  Metrics();

  // The series of `model` version `version` (a number, or ""), shared by
  // whoever holds them; when the last holder lets go (a version unloaded),
  // they leave /metrics, so unloaded versions leave no series behind.
  // Unknown model names are not passed here, so clients cannot blow up the
  // label cardinality.
  std::shared_ptr<ModelMetrics> ForVersion(const std::string& model, const std::string& version);
  // The series of `model` outside any version (version ""), kept as long as
  // the Metrics.
  ModelMetrics& ForModel(const std::string& model);
  // Model-level: whether a version serves, and loads that failed.
  void SetLoaded(const std::string& model, bool loaded);
  void CountLoadFailure(const std::string& model);
  // A request naming no model of the repository (label kUnknownModelLabel).
  void CountUnknownModelRequest(const char* api, absl::StatusCode code);

  // The families and series of the sessions (server/sessions/session_manager.h).
  SessionMetrics Sessions() const { return sessions_; }

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  prometheus::Gauge& memory_limit() { return memory_; }
  prometheus::Gauge& memory_reserved() { return memory_reserved_; }
  prometheus::Gauge& memory_engine_reserve() { return memory_set_aside_; }

 private:
  ModelMetrics* Create(const std::string& model, const std::string& version);
  SessionMetrics MakeSessionMetrics();
  void Remove(ModelMetrics* m);

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
  prometheus::Family<prometheus::Counter>& split_requests_;
  prometheus::Family<prometheus::Counter>& yielded_step_calls_;
  prometheus::Family<prometheus::Counter>& primitive_cache_misses_;
  prometheus::Gauge& memory_;
  prometheus::Gauge& memory_reserved_;
  prometheus::Gauge& memory_set_aside_;
  const SessionMetrics sessions_;  // after registry_
  Mutex mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>> models_ ABSL_GUARDED_BY(mu_);  // version ""
  std::map<std::pair<std::string, std::string>, std::weak_ptr<ModelMetrics>> versions_
      ABSL_GUARDED_BY(mu_);
};

// Values of the `api` label of mha_requests_total: which front end answered.
inline constexpr char kApiMha[] = "mha.v1";
inline constexpr char kApiKserve[] = "kserve.v2";
inline constexpr char kApiKserveHttp[] = "kserve.v2.http";

// The reasons of mha_dropped_requests_total, each exported from the start.
inline constexpr const char* kDropReasons[] = {"deadline", "cancelled", "queue_full", "memory",
                                               "message_size"};

// The reasons of mha_session_evictions_total and mha_session_steps_dropped_total,
// each exported at 0 from a model's first load.
inline constexpr const char* kSessionEvictionReasons[] = {"cache_full", "expired", "failed"};
inline constexpr const char* kStepDropReasons[] = {"memory", "deadline", "cancelled", "queue_full"};

// The label value used for requests naming no loaded model.
inline constexpr char kUnknownModelLabel[] = "_unknown";

// "OK", "INVALID_ARGUMENT", ...: the gRPC code names used as label values.
std::string CodeLabel(absl::StatusCode code);

}  // namespace mha::server

#endif  // MHA_SERVER_OBSERVABILITY_METRICS_H_
