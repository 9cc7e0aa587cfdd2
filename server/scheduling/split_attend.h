// A long Attend request computed in pieces while sessions step (stall-free
// batching, as Sarathi-Serve's chunked prefill): its keys and values are
// projected once into a private cache, then its query rows go as chunks,
// each a step of the batcher's calls, so a session step waits at most for
// one chunk, never for the whole request.
#ifndef MHA_SERVER_SCHEDULING_SPLIT_ATTEND_H_
#define MHA_SERVER_SCHEDULING_SPLIT_ATTEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/attention_request.h"
#include "engine/mha_engine.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/attend_call.h"
#include "server/scheduling/task.h"

namespace mha::server {

// Whether `request` can be computed in chunks of query rows with the same
// result: one sequence, no attention mask or causal flag (a key padding
// mask is fine), no weights asked, and the engine's cache holds keys and
// values in its compute type (an fp32 model with a bf16 session cache
// would round them).
bool Splittable(const AttentionRequest& request, const MhaEngine& engine);

// Where a split request's chunks go once its keys and values are projected
// (the batcher's step lane).
using QueueChunks = std::function<void(std::vector<std::unique_ptr<StepTask>>)>;

// The task that starts computing `call` (Splittable, its working memory
// reserved) in chunks of `chunk_rows` query rows: run on a worker, it
// projects the keys and values, then hands the chunks to `queue`. The call
// is answered once, when the last chunk is done, or at the first failure,
// cancellation or passed deadline. Takes `call` only once nothing can throw
// (std::bad_alloc leaves it with the caller). Borrows the engine, the
// metrics and the statistics (may be null), which must outlive the chunks.
std::unique_ptr<ProjectionTask> SplitAttendCall(std::unique_ptr<AttendCall>& call,
                                                const MhaEngine& engine, int64_t chunk_rows,
                                                QueueChunks queue, const ModelMetrics& metrics,
                                                ModelStatistics* statistics);

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_SPLIT_ATTEND_H_
