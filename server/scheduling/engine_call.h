// Running a model version's engine calls.
#ifndef MHA_SERVER_SCHEDULING_ENGINE_CALL_H_
#define MHA_SERVER_SCHEDULING_ENGINE_CALL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/mha_engine.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/clock.h"
#include "server/scheduling/step_starter.h"
#include "server/scheduling/task.h"

namespace mha::server {

// Runs engine calls on pool workers: drops what nobody waits for before
// spending compute on it, computes started steps (in a call of their own,
// answered first) and then Attend requests, hands each its results, answers
// every one exactly once (an out-of-memory failure included), and records
// each call's statistics and metrics. Borrows the engine, the metrics, the
// clock and the statistics (may be null). Thread-safe: workers run calls of
// one model at once; its only state is an atomic count.
class EngineCallRunner {
 public:
  EngineCallRunner(const MhaEngine& engine, ModelMetrics& metrics, const Clock& clock,
                   ModelStatistics* statistics);

  // Answers the requests of `batch` that were refused while queued or that
  // nobody waits for any more, and returns the rest (live), each with its
  // time in the queue observed.
  std::vector<std::unique_ptr<AttendCall>> DropUnwanted(
      std::vector<std::unique_ptr<AttendCall>> batch) const;
  // Runs each projection (or answers it when unwanted), each one's memory
  // back before the next.
  void RunProjections(std::vector<std::unique_ptr<ProjectionTask>> projections,
                      Workspace& ws) const;
  // Computes and answers `steps`, in an engine call of their own, then the
  // `live` requests in another (a step waits for its own rows, not for a
  // capped call's Attend rows as well). Every one is answered.
  void Run(const std::vector<std::unique_ptr<AttendCall>>& live, std::vector<StartedStep>& steps,
           Workspace& ws);

 private:
  // One engine call of requests or of steps (never both); encodes the
  // requests' answers, records the call (RecordCall), then answers the
  // steps and the requests; `answered` counts those answered, so that on an
  // allocation failure Run answers only the rest.
  void Compute(const std::vector<std::unique_ptr<AttendCall>>& live,
               std::vector<StartedStep>& steps, Workspace& ws, size_t& answered);
  // Records one engine call's statistics (ModelStatistics::Record): the
  // requests whose `answers` are OK and the counted steps, with the call's
  // stages (merging inputs from `merging`, the engine call from `start` to
  // `computed`, encoding the answers since).
  void RecordCall(const std::vector<std::unique_ptr<AttendCall>>& live,
                  const std::vector<absl::Status>& answers, const std::vector<StartedStep>& steps,
                  absl::Time merging, absl::Time start, absl::Time computed) const;
  // Whether every request of `live` was cancelled or passed its deadline
  // (its engine call then stops at its next yield point). Those before
  // `first_wanted` are known gone: a check costs one request while the
  // first stays wanted.
  bool NobodyWaits(const std::vector<std::unique_ptr<AttendCall>>& live,
                   size_t& first_wanted) const;
  // Adds the primitives the engine created since the last report (on any
  // worker) to the metric.
  void ReportPrimitiveCacheMisses();

  const MhaEngine& engine_;
  ModelMetrics& metrics_;
  const Clock& clock_;
  ModelStatistics* const statistics_;
  std::atomic<uint64_t> reported_misses_;  // engine's count already in the metric
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_ENGINE_CALL_H_
