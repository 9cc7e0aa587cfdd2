#include "server/observability/model_statistics.h"

#include <algorithm>
#include <new>

#include "absl/time/clock.h"

namespace mha::server {
namespace {

uint64_t Nanoseconds(absl::Duration d) {
  return static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(d)));
}

}  // namespace

void ModelStatistics::Duration::Add(absl::Duration d, uint64_t times) {
  count += times;
  ns += times * Nanoseconds(d);
}

void ModelStatistics::Duration::AddSum(uint64_t times, absl::Duration sum) {
  count += times;
  ns += Nanoseconds(sum);
}

void ModelStatistics::Call::AddAnswer(absl::Duration since_arrival, absl::Duration queued,
                                      int64_t answer_rows) {
  ++answers;
  rows += static_cast<uint64_t>(std::max<int64_t>(0, answer_rows));
  total += since_arrival;
  waited += queued;
}

void ModelStatistics::Record(const Call& call) {
  if (call.answers == 0) return;
  MutexLock lock(mu_);
  // The entries first: if one cannot be made, nothing changes.
  BatchStages *by_requests = nullptr, *by_size = nullptr;
  try {
    by_requests = &data_.batches[call.batch_requests];
    by_size = &data_.batch_sizes[call.batch_rows];
  } catch (const std::bad_alloc&) {  // the call goes uncounted; its answers still leave
    return;
  }
  ++data_.execution_count;
  data_.inference_count += call.rows;
  data_.last_inference_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  data_.success.AddSum(call.answers, call.total);
  data_.queue.AddSum(call.answers, call.waited);
  data_.compute_input.Add(call.input, call.answers);
  data_.compute_infer.Add(call.infer, call.answers);
  data_.compute_output.Add(call.output, call.answers);
  for (BatchStages* batch : {by_requests, by_size}) {
    batch->compute_input.Add(call.input);
    batch->compute_infer.Add(call.infer);
    batch->compute_output.Add(call.output);
  }
}

void ModelStatistics::RecordFailure(absl::Duration total) {
  MutexLock lock(mu_);
  data_.fail.Add(total);
}

ModelStatistics::Snapshot ModelStatistics::Read() const {
  MutexLock lock(mu_);
  return data_;
}

}  // namespace mha::server
