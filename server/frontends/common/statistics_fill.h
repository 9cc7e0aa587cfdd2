// A model's statistics into either API's message: mha.v1's
// ModelVersionStatistics and KServe's (Triton's) ModelStatistics name their
// stages alike (success, fail, queue, compute_input/infer/output, each a
// count and nanoseconds), so one template fills both.
#ifndef MHA_SERVER_FRONTENDS_STATISTICS_FILL_H_
#define MHA_SERVER_FRONTENDS_STATISTICS_FILL_H_

#include "server/observability/model_statistics.h"

namespace mha::server {

template <typename DurationProto>
void FillDuration(const ModelStatistics::Duration& d, DurationProto* out) {
  out->set_count(d.count);
  out->set_ns(d.ns);
}

// The three compute stages of `stages` (a snapshot or one batch size's).
template <typename Stages, typename StagesProto>
void FillComputeStages(const Stages& stages, StagesProto* out) {
  FillDuration(stages.compute_input, out->mutable_compute_input());
  FillDuration(stages.compute_infer, out->mutable_compute_infer());
  FillDuration(stages.compute_output, out->mutable_compute_output());
}

// success, fail, queue and the compute stages.
template <typename StagesProto>
void FillStages(const ModelStatistics::Snapshot& s, StagesProto* out) {
  FillDuration(s.success, out->mutable_success());
  FillDuration(s.fail, out->mutable_fail());
  FillDuration(s.queue, out->mutable_queue());
  FillComputeStages(s, out);
}

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_STATISTICS_FILL_H_
