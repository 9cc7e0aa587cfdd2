#include "server/observability/metrics.h"

#include <cmath>
#include <cstdlib>
#include <initializer_list>

#include "absl/status/status.h"

namespace mha::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// Boundaries mantissa x 10^exponent for each exponent in [first, last) and
// each mantissa (in tenths), then 10^last, each one correctly rounded
// division or product of exact integers. prometheus-cpp prints a bound with
// 16 significant digits (%.16g): a product of rounded decades printed
// le="0.0006000000000000001", and even the double nearest 0.0006 prints
// le="0.0005999999999999999", so the mantissas are ones whose every bound
// prints as its decimal (tested: MetricsTest.HistogramBoundsPrintAsShortDecimals).
prometheus::Histogram::BucketBoundaries Decades(int first, int last,
                                                std::initializer_list<int> tenths) {
  auto power = [](int exponent) {
    double p = 1;
    for (int i = 0; i < exponent; ++i) p *= 10;  // exact up to 10^22
    return p;
  };
  prometheus::Histogram::BucketBoundaries b;
  for (int e = first; e < last; ++e) {
    for (const int t : tenths) b.push_back(e < 1 ? t / power(1 - e) : t * power(e - 1));
  }
  b.push_back(last < 0 ? 1 / power(-last) : power(last));
  return b;
}

// Seconds from 100 us to 1 s, eight buckets per decade (1, 1.5, 2, 2.5, 3,
// 4, 5, 7.5): a session step's p99 read in milliseconds. Only for the
// server's unlabelled step histograms (a per-model family with this many
// buckets would cost thousands of series with a thousand models).
prometheus::Histogram::BucketBoundaries FineSecondsBuckets() {
  return Decades(-4, 0, {10, 15, 20, 25, 30, 40, 50, 75});
}

// Seconds from 10 us to 10 s, three buckets per decade (1, 2.5, 5).
prometheus::Histogram::BucketBoundaries SecondsBuckets() { return Decades(-5, 1, {10, 25, 50}); }

prometheus::Histogram::BucketBoundaries PowersOfTwo(int max_exponent) {
  prometheus::Histogram::BucketBoundaries b;
  for (int e = 0; e <= max_exponent; ++e) b.push_back(std::ldexp(1.0, e));
  return b;
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(BuildCounter()
                    .Name("mha_requests_total")
                    .Help("Attention requests answered (Attend, ModelInfer), by model, version, "
                          "api and gRPC status code")
                    .Register(*registry_)),
      request_duration_(BuildHistogram()
                            .Name("mha_request_duration_seconds")
                            .Help("Attend handler in to response out")
                            .Register(*registry_)),
      queue_duration_(BuildHistogram()
                          .Name("mha_queue_duration_seconds")
                          .Help("Time a request waited in the batch queue")
                          .Register(*registry_)),
      compute_duration_(BuildHistogram()
                            .Name("mha_compute_duration_seconds")
                            .Help("Engine time of one batch")
                            .Register(*registry_)),
      batch_requests_(BuildHistogram()
                          .Name("mha_batch_requests")
                          .Help("Requests merged into one engine call")
                          .Register(*registry_)),
      batch_tokens_(BuildHistogram()
                        .Name("mha_batch_tokens")
                        .Help("Query + key tokens of one engine call")
                        .Register(*registry_)),
      queue_depth_(BuildGauge()
                       .Name("mha_queue_depth")
                       .Help("Requests waiting in the batch queue")
                       .Register(*registry_)),
      inflight_(BuildGauge()
                    .Name("mha_inflight_requests")
                    .Help("Attend requests received and not yet answered")
                    .Register(*registry_)),
      tokens_(BuildCounter()
                  .Name("mha_tokens_total")
                  .Help("Query + key tokens computed")
                  .Register(*registry_)),
      dropped_(BuildCounter()
                   .Name("mha_dropped_requests_total")
                   .Help("Requests not computed, by reason: deadline, cancelled, queue_full, "
                         "memory (the memory budget), message_size (response above the limit)")
                   .Register(*registry_)),
      loaded_(BuildGauge()
                  .Name("mha_model_loaded")
                  .Help("1 when a version of the model serves, 0 when none does")
                  .Register(*registry_)),
      load_failures_(BuildCounter()
                         .Name("mha_model_load_failures_total")
                         .Help("Loads and reloads of a model (or one of its versions) that "
                               "failed; what served before goes on serving")
                         .Register(*registry_)),
      split_requests_(BuildCounter()
                          .Name("mha_split_requests_total")
                          .Help("Attend requests computed in chunks of query rows beside "
                                "session steps (dynamic_batching.max_batch_tokens_with_steps)")
                          .Register(*registry_)),
      yielded_step_calls_(BuildCounter()
                              .Name("mha_yielded_step_calls_total")
                              .Help("Engine calls of session steps a worker ran inside a "
                                    "longer call of the model's queue or another's, between "
                                    "its blocks, while every worker was in a call")
                              .Register(*registry_)),
      primitive_cache_misses_(BuildCounter()
                                  .Name("mha_engine_primitive_cache_misses_total")
                                  .Help("oneDNN primitives created while serving (a request "
                                        "of a new shape; warmup_lengths avoid them)")
                                  .Register(*registry_)),
      memory_(BuildGauge()
                  .Name("mha_memory_limit_bytes")
                  .Help("Memory limit for requests in flight and the engines' reserve "
                        "(--memory_limit_bytes)")
                  .Register(*registry_)
                  .Add({})),
      memory_reserved_(BuildGauge()
                           .Name("mha_memory_reserved_bytes")
                           .Help("Working memory reserved by requests in flight "
                                 "(queued, computing, answering)")
                           .Register(*registry_)
                           .Add({})),
      memory_set_aside_(BuildGauge()
                            .Name("mha_memory_engine_reserve_bytes")
                            .Help("Memory set aside from the limit before requests: the "
                                  "process, the models' packed weights and primitive "
                                  "allowance, the workers' workspaces and the session cache; "
                                  "follows loads and unloads")
                            .Register(*registry_)
                            .Add({})),
      sessions_(MakeSessionMetrics()) {}

ModelMetrics* Metrics::Create(const std::string& model, const std::string& version) {
  const prometheus::Labels labels = {{"model", model}, {"version", version}};
  auto* m = new ModelMetrics();
  m->model = model;
  m->version = version;
  m->request_duration = &request_duration_.Add(labels, SecondsBuckets());
  m->queue_duration = &queue_duration_.Add(labels, SecondsBuckets());
  m->compute_duration = &compute_duration_.Add(labels, SecondsBuckets());
  m->batch_requests = &batch_requests_.Add(labels, PowersOfTwo(10));
  m->batch_tokens = &batch_tokens_.Add(labels, PowersOfTwo(20));
  m->queue_depth = &queue_depth_.Add(labels);
  m->inflight = &inflight_.Add(labels);
  m->tokens = &tokens_.Add(labels);
  m->primitive_cache_misses = &primitive_cache_misses_.Add(labels);
  m->split_requests = &split_requests_.Add(labels);
  m->yielded_step_calls = &yielded_step_calls_.Add(labels);
  // Every reason's series from the start, so rate() alerts work before the
  // first drop.
  for (const char* reason : kDropReasons) {
    m->dropped[reason] =
        &dropped_.Add({{"model", model}, {"version", version}, {"reason", reason}});
  }
  m->requests_family = &requests_;
  return m;
}

void Metrics::Remove(ModelMetrics* m) {
  request_duration_.Remove(m->request_duration);
  queue_duration_.Remove(m->queue_duration);
  compute_duration_.Remove(m->compute_duration);
  batch_requests_.Remove(m->batch_requests);
  batch_tokens_.Remove(m->batch_tokens);
  queue_depth_.Remove(m->queue_depth);
  inflight_.Remove(m->inflight);
  tokens_.Remove(m->tokens);
  primitive_cache_misses_.Remove(m->primitive_cache_misses);
  split_requests_.Remove(m->split_requests);
  yielded_step_calls_.Remove(m->yielded_step_calls);
  for (const auto& [reason, counter] : m->dropped) dropped_.Remove(counter);
  MutexLock lock(m->requests_mu);
  for (const auto& [key, counter] : m->requests) requests_.Remove(counter);
}

std::shared_ptr<ModelMetrics> Metrics::ForVersion(const std::string& model,
                                                  const std::string& version) {
  MutexLock lock(mu_);
  std::weak_ptr<ModelMetrics>& slot = versions_[{model, version}];
  if (std::shared_ptr<ModelMetrics> held = slot.lock()) return held;
  std::shared_ptr<ModelMetrics> created(Create(model, version), [this](ModelMetrics* m) {
    MutexLock lock(mu_);
    auto it = versions_.find({m->model, m->version});
    // A holder that came after the last one let go got the same series from
    // the families (they were not removed yet): they stay for it.
    if (it == versions_.end() || it->second.expired()) {
      if (it != versions_.end()) versions_.erase(it);
      Remove(m);
    }
    delete m;
  });
  slot = created;
  return created;
}

ModelMetrics& Metrics::ForModel(const std::string& model) {
  MutexLock lock(mu_);
  std::unique_ptr<ModelMetrics>& m = models_[model];
  if (m == nullptr) m.reset(Create(model, ""));
  return *m;
}

void ModelMetrics::CountRequest(const char* api, absl::StatusCode code) {
  prometheus::Counter* counter;
  {
    MutexLock lock(requests_mu);
    prometheus::Counter*& slot = requests[{api, static_cast<int>(code)}];
    if (slot == nullptr) {
      slot = &requests_family->Add(
          {{"model", model}, {"version", version}, {"api", api}, {"code", CodeLabel(code)}});
    }
    counter = slot;
  }
  counter->Increment();
}

void Metrics::SetLoaded(const std::string& model, bool loaded) {
  ForModel(model);
  // Exported from the first load on, at 0, so that alerts have a series to
  // match before the first event.
  load_failures_.Add({{"model", model}});
  sessions_.active->Add({{"model", model}});
  for (const char* reason : kSessionEvictionReasons) {
    sessions_.evictions->Add({{"model", model}, {"reason", reason}});
  }
  for (const char* reason : kStepDropReasons) {
    sessions_.steps_dropped->Add({{"model", model}, {"reason", reason}});
  }
  loaded_.Add({{"model", model}}).Set(loaded ? 1 : 0);
}

void Metrics::CountLoadFailure(const std::string& model) {
  ForModel(model);
  load_failures_.Add({{"model", model}}).Increment();
}

void Metrics::CountUnknownModelRequest(const char* api, absl::StatusCode code) {
  requests_
      .Add(
          {{"model", kUnknownModelLabel}, {"version", ""}, {"api", api}, {"code", CodeLabel(code)}})
      .Increment();
}

std::string CodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  return name.empty() ? "UNKNOWN" : name;
}

SessionMetrics Metrics::MakeSessionMetrics() {
  SessionMetrics m;
  m.active = &BuildGauge()
                  .Name("mha_sessions_active")
                  .Help("Sessions open (their key/value caches held), by model")
                  .Register(*registry_);
  m.evictions = &BuildCounter()
                     .Name("mha_session_evictions_total")
                     .Help(
                         "Sessions ended by the server, by model and reason: cache_full "
                         "(evicted, least recently used first), expired (idle timeout), "
                         "failed (a step the engine could not compute)")
                     .Register(*registry_);
  m.cache_bytes = &BuildGauge()
                       .Name("mha_session_cache_bytes")
                       .Help("Bytes of key/value cache blocks the sessions hold")
                       .Register(*registry_)
                       .Add({});
  m.append_tokens = &BuildCounter()
                         .Name("mha_append_tokens_total")
                         .Help("Tokens computed by session steps (Append)")
                         .Register(*registry_)
                         .Add({});
  m.append_duration = &BuildHistogram()
                           .Name("mha_append_duration_seconds")
                           .Help("A session step from queued to computed")
                           .Register(*registry_)
                           .Add({}, FineSecondsBuckets());
  m.append_queue_duration =
      &BuildHistogram()
           .Name("mha_append_queue_duration_seconds")
           .Help(
               "A session step from queued to taken into an engine call (the rest of "
               "mha_append_duration_seconds is its call's compute and the answer)")
           .Register(*registry_)
           .Add({}, FineSecondsBuckets());
  auto& queue_split =
      BuildHistogram()
          .Name("mha_append_queue_split_duration_seconds")
          .Help(
              "mha_append_queue_duration_seconds by the workers when the step was queued: "
              "all_busy (every worker in an engine call: it waits behind a running call) or "
              "some_free (it waits for a worker to wake and take it)")
          .Register(*registry_);
  m.append_queue_all_busy = &queue_split.Add({{"workers", "all_busy"}}, FineSecondsBuckets());
  m.append_queue_some_free = &queue_split.Add({{"workers", "some_free"}}, FineSecondsBuckets());
  m.steps_dropped = &BuildCounter()
                         .Name("mha_session_steps_dropped_total")
                         .Help(
                             "Session steps refused after they were queued, never computed, "
                             "by model and reason: deadline, cancelled, memory")
                         .Register(*registry_);
  return m;
}

}  // namespace mha::server
