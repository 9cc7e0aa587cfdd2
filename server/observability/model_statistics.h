// What Triton's statistics extension reports for one model version: how many
// requests and engine calls, and the cumulative time of each stage.
#ifndef MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_
#define MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_

#include <cstdint>
#include <map>

#include "absl/time/time.h"
#include "engine/mutex.h"

namespace mha::server {

// Owns the counters of one model version. Every figure of an engine call is
// added in one step (Record), so that no snapshot shows a call's requests
// counted in one stage and not yet in another: in every Read,
// success.count == queue.count == compute_input/infer/output.count, and
// the sum of batch_size x executions over batch_sizes is inference_count
// as long as no computed request failed. Thread-safe.
class ModelStatistics {
 public:
  struct Duration {
    uint64_t count = 0, ns = 0;
    void Add(absl::Duration d, uint64_t times = 1);
    // `times` more, taking `sum` together.
    void AddSum(uint64_t times, absl::Duration sum);
  };
  // One engine call's stages, per requests merged into it.
  struct BatchStages {
    Duration compute_input, compute_infer, compute_output;
  };
  struct Snapshot {
    uint64_t last_inference_ms = 0;  // Unix time of the last answer, 0: none
    uint64_t inference_count = 0;    // rows computed (B of each request)
    // Executions: engine calls with answers that left OK (a split
    // request's projection and chunks are one).
    uint64_t execution_count = 0;
    Duration success, fail;  // whole requests, arrival to answer
    Duration queue;          // waiting for an engine call
    // Per request: merging inputs and allocating outputs, the engine call,
    // encoding the answers (each request counted with its call's time).
    Duration compute_input, compute_infer, compute_output;
    std::map<uint64_t, BatchStages> batches;  // by requests per engine call (mha.v1)
    // By rows per engine call: Triton's batch_size, the unit
    // inference_count counts in (a request of B = 2 alone is a batch of 2).
    std::map<uint64_t, BatchStages> batch_sizes;
  };

  // What one engine call adds once its answers are ready, before any of
  // them leaves (so that a client reading statistics after its answer sees
  // its call). Requests and session steps alike: a step is a request of
  // one row, as Triton counts each request of a sequence (its word for a
  // session).
  struct Call {
    // What the engine call held, and its stages.
    uint64_t batch_requests = 0, batch_rows = 0;
    absl::Duration input, infer, output;
    // Its answers that leave OK, summed.
    uint64_t answers = 0, rows = 0;
    absl::Duration total, waited;

    // An answer ready to leave OK: `total` since its arrival, `waited` in
    // the queue, of `rows` rows.
    void AddAnswer(absl::Duration total, absl::Duration waited, int64_t rows);
  };

  // Adds all of `call` in one step (nothing when it has no answers, or
  // when out of memory). Does not throw.
  void Record(const Call& call);
  // A request that failed, `total` after its arrival; counted once a request.
  void RecordFailure(absl::Duration total);
  Snapshot Read() const;

 private:
  mutable Mutex mu_;
  Snapshot data_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::server

#endif  // MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_
