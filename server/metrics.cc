#include "server/metrics.h"

#include <cmath>

#include "absl/status/status.h"

namespace mha::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// Seconds from 10 us to 10 s, three buckets per decade (1, 2.5, 5).
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double decade = 1e-5; decade < 10.0; decade *= 10) {
    b.push_back(decade);
    b.push_back(decade * 2.5);
    b.push_back(decade * 5);
  }
  b.push_back(10.0);
  return b;
}

prometheus::Histogram::BucketBoundaries PowersOfTwo(int max_exponent) {
  prometheus::Histogram::BucketBoundaries b;
  for (int e = 0; e <= max_exponent; ++e) b.push_back(std::ldexp(1.0, e));
  return b;
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(BuildCounter().Name("mha_requests_total")
                    .Help("Attention requests answered (Attend, ModelInfer), by model, api and gRPC status code")
                    .Register(*registry_)),
      request_duration_(BuildHistogram().Name("mha_request_duration_seconds")
                            .Help("Attend handler in to response out")
                            .Register(*registry_)),
      queue_duration_(BuildHistogram().Name("mha_queue_duration_seconds")
                          .Help("Time a request waited in the batch queue")
                          .Register(*registry_)),
      compute_duration_(BuildHistogram().Name("mha_compute_duration_seconds")
                            .Help("Engine time of one batch")
                            .Register(*registry_)),
      batch_requests_(BuildHistogram().Name("mha_batch_requests")
                          .Help("Requests merged into one engine call")
                          .Register(*registry_)),
      batch_tokens_(BuildHistogram().Name("mha_batch_tokens")
                        .Help("Query + key tokens of one engine call")
                        .Register(*registry_)),
      queue_depth_(BuildGauge().Name("mha_queue_depth")
                       .Help("Requests waiting in the batch queue")
                       .Register(*registry_)),
      inflight_(BuildGauge().Name("mha_inflight_requests")
                    .Help("Attend requests received and not yet answered")
                    .Register(*registry_)),
      tokens_(BuildCounter().Name("mha_tokens_total")
                  .Help("Query + key tokens computed")
                  .Register(*registry_)),
      dropped_(BuildCounter().Name("mha_dropped_requests_total")
                   .Help("Requests not computed, by reason: deadline, cancelled, queue_full, "
                         "memory (the memory budget), message_size (response above the limit)")
                   .Register(*registry_)),
      loaded_(BuildGauge().Name("mha_model_loaded")
                  .Help("1 when a version of the model serves, 0 when none does")
                  .Register(*registry_)),
      load_failures_(BuildCounter().Name("mha_model_load_failures_total")
                         .Help("Loads and reloads of a model (or one of its versions) that "
                               "failed; what served before goes on serving")
                         .Register(*registry_)),
      primitive_cache_misses_(BuildCounter().Name("mha_engine_primitive_cache_misses_total")
                                  .Help("oneDNN primitives created while serving (a request "
                                        "of a new shape; warmup_lengths avoid them)")
                                  .Register(*registry_)),
      memory_(BuildGauge().Name("mha_memory_limit_bytes")
                  .Help("Memory limit for requests in flight and the engines' reserve "
                        "(--memory_limit_bytes)")
                  .Register(*registry_)
                  .Add({})),
      memory_reserved_(BuildGauge().Name("mha_memory_reserved_bytes")
                           .Help("Working memory reserved by requests in flight "
                                 "(queued, computing, answering)")
                           .Register(*registry_)
                           .Add({})) {}

ModelMetrics& Metrics::ForModel(const std::string& model) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<ModelMetrics>& m = models_[model];
  if (m == nullptr) {
    const prometheus::Labels labels = {{"model", model}};
    m = std::make_unique<ModelMetrics>();
    m->request_duration = &request_duration_.Add(labels, SecondsBuckets());
    m->queue_duration = &queue_duration_.Add(labels, SecondsBuckets());
    m->compute_duration = &compute_duration_.Add(labels, SecondsBuckets());
    m->batch_requests = &batch_requests_.Add(labels, PowersOfTwo(10));
    m->batch_tokens = &batch_tokens_.Add(labels, PowersOfTwo(20));
    m->queue_depth = &queue_depth_.Add(labels);
    m->inflight = &inflight_.Add(labels);
    m->tokens = &tokens_.Add(labels);
    m->loaded = &loaded_.Add(labels);
    load_failures_.Add(labels);
    m->primitive_cache_misses = &primitive_cache_misses_.Add(labels);
    // Every reason's series from the start, so rate() alerts work before
    // the first drop.
    for (const char* reason : kDropReasons) dropped_.Add({{"model", model}, {"reason", reason}});
  }
  return *m;
}

void Metrics::CountRequest(const std::string& model, const char* api, absl::StatusCode code) {
  requests_.Add({{"model", model}, {"api", api}, {"code", CodeLabel(code)}}).Increment();
}

void Metrics::CountDropped(const std::string& model, const std::string& reason) {
  dropped_.Add({{"model", model}, {"reason", reason}}).Increment();
}

void Metrics::CountLoadFailure(const std::string& model) {
  load_failures_.Add({{"model", model}}).Increment();
}

std::string CodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  return name.empty() ? "UNKNOWN" : name;
}

}  // namespace mha::server
