// A model version's configuration in Triton's terms, for the ModelConfig RPC
// of inference.GRPCInferenceService: what tritonclient's get_model_config(),
// perf_analyzer and Model Analyzer read before anything else.
#ifndef MHA_SERVER_FRONTENDS_TRITON_CONFIG_H_
#define MHA_SERVER_FRONTENDS_TRITON_CONFIG_H_

#include <cstdint>

#include "inference/model_config.pb.h"
#include "server/models/model_repository.h"

namespace mha::server {

// Fills `out` for `version`: inputs and outputs as ModelMetadata gives them
// (the batch dimension left out, as Triton does when max_batch_size > 0;
// variable lengths -1), FP32 and BOOL as TYPE_*, the version policy, dynamic
// batching (its queue delay) unless batching is off, one CPU instance, and
// our own settings (dims, options, token caps) as parameters.
// `max_request_tokens` bounds the sequences of a request: max_batch_size.
void DescribeTritonConfig(const ModelVersion& version, int64_t max_request_tokens,
                          inference::ModelConfig* out);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_TRITON_CONFIG_H_
