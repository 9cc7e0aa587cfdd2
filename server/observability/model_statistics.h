// What Triton's statistics extension reports for one model version: how many
// requests and engine calls, and the cumulative time of each stage.
#ifndef MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_
#define MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_

#include <cstdint>
#include <map>
#include <mutex>

#include "absl/time/time.h"

namespace mha::server {

// Owns the counters of one model version; fed by the dispatcher (requests
// answered) and the batcher (queueing, engine calls). Thread-safe.
class ModelStatistics {
 public:
  struct Duration {
    uint64_t count = 0, ns = 0;
    void Add(absl::Duration d, uint64_t times = 1);
  };
  // One engine call's stages, per requests merged into it.
  struct BatchStages {
    Duration compute_input, compute_infer, compute_output;
  };
  struct Snapshot {
    uint64_t last_inference_ms = 0;  // Unix time of the last answer, 0: none
    uint64_t inference_count = 0;    // sequences computed (B of each request)
    uint64_t execution_count = 0;    // engine calls
    Duration success, fail;          // whole requests, handler in to answer
    Duration queue;                  // waiting for a batch
    // Per request: merging inputs and allocating outputs, the engine call,
    // encoding the answers (each request counted with its batch's time).
    Duration compute_input, compute_infer, compute_output;
    std::map<uint64_t, BatchStages> batches;  // by requests per engine call (mha.v1)
    // By sequences per engine call: Triton's batch_size, the unit
    // inference_count counts in (a request of B = 2 alone is a batch of 2).
    std::map<uint64_t, BatchStages> batch_sizes;
  };

  // A request answered (ok or not) after `total`, of `sequences` sequences.
  void RequestDone(bool ok, absl::Duration total, int64_t sequences);
  void Queued(absl::Duration waited);
  // An engine call of `requests` requests holding `sequences` sequences,
  // before they are answered (so that a client reading statistics after
  // its answer sees its call)...
  void Executed(uint64_t requests, uint64_t sequences, absl::Duration input,
                absl::Duration infer);
  // ...and the time its answers took to encode and hand to gRPC.
  void Answered(uint64_t requests, uint64_t sequences, absl::Duration output);
  Snapshot Read() const;

 private:
  mutable std::mutex mu_;
  Snapshot data_;  // guarded by mu_
};

}  // namespace mha::server

#endif  // MHA_SERVER_OBSERVABILITY_MODEL_STATISTICS_H_
