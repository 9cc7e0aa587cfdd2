#include "server/observability/model_statistics.h"

#include "absl/time/clock.h"

namespace mha::server {

void ModelStatistics::Duration::Add(absl::Duration d, uint64_t times) {
  count += times;
  ns += times * static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(d)));
}

void ModelStatistics::RequestDone(bool ok, absl::Duration total, int64_t sequences) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ok) {
    data_.success.Add(total);
    data_.inference_count += static_cast<uint64_t>(std::max<int64_t>(0, sequences));
    data_.last_inference_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  } else {
    data_.fail.Add(total);
  }
}

void ModelStatistics::Queued(absl::Duration waited) {
  std::lock_guard<std::mutex> lock(mu_);
  data_.queue.Add(waited);
}

void ModelStatistics::Executed(uint64_t requests, uint64_t sequences, absl::Duration input,
                               absl::Duration infer) {
  std::lock_guard<std::mutex> lock(mu_);
  ++data_.execution_count;
  data_.compute_input.Add(input, requests);
  data_.compute_infer.Add(infer, requests);
  for (BatchStages* batch : {&data_.batches[requests], &data_.batch_sizes[sequences]}) {
    batch->compute_input.Add(input);
    batch->compute_infer.Add(infer);
  }
}

void ModelStatistics::Answered(uint64_t requests, uint64_t sequences, absl::Duration output) {
  std::lock_guard<std::mutex> lock(mu_);
  data_.compute_output.Add(output, requests);
  data_.batches[requests].compute_output.Add(output);
  data_.batch_sizes[sequences].compute_output.Add(output);
}

ModelStatistics::Snapshot ModelStatistics::Read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return data_;
}

}  // namespace mha::server
