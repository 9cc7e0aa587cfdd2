// mha.v1's session messages to the session manager's parameters and back,
// with the same checks as Attend's codec (shapes, dtypes, finite values).
#ifndef MHA_SERVER_FRONTENDS_SESSION_CODEC_H_
#define MHA_SERVER_FRONTENDS_SESSION_CODEC_H_

#include "absl/status/statusor.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/request_codec.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// The longest client-chosen session id; ids are [A-Za-z0-9._:-].
inline constexpr size_t kMaxSessionIdLength = 128;

// INVALID_ARGUMENT naming `field` unless `id` is 1-128 characters of
// [A-Za-z0-9._:-].
absl::Status CheckSessionId(const std::string& id, const char* field);

// An OpenSession for `version`. Tensors are views of `request`'s bytes: it
// must outlive the result. Errors name the field ("memory: ...").
absl::StatusOr<OpenParams> DecodeOpenSession(const v1::OpenSessionRequest& request,
                                             VersionPtr version, const RequestLimits& limits);

// An Append's query for a session of a model with `dims`: one sequence,
// [1, T, E] or [T, E]. Views `request`'s bytes like DecodeOpenSession.
// `query_data`: where the query's bytes are when the message was read
// around them (proto/wire/), or null: in the message.
absl::StatusOr<StepParams> DecodeAppend(const v1::AppendRequest& request, const AttentionDims& dims,
                                        const RequestLimits& limits,
                                        const ReceivedBytes* query_data = nullptr);

// A cross session's memory (`memory.key`, and `value`, `key_padding_mask`
// when given; its query is ignored) as an AttentionRequest with a one-token
// zero query, so that the request's own checks validate it.
absl::StatusOr<AttentionRequest> MemoryRequest(const AttentionDims& dims, RequestInputs memory,
                                               const RequestLimits& limits, DTypeSpelling spelling);
// A step's query ([1, T, E] or [T, E], T >= 1), checked as a self-attention
// query of a model with `dims`.
absl::StatusOr<AttentionRequest> StepQuery(const AttentionDims& dims, const TensorView& query,
                                           bool need_weights, const RequestLimits& limits,
                                           DTypeSpelling spelling);

void EncodeSession(const SessionInfo& info, v1::Session* out);

// What encoding a step's response needs from its request. Plain value type.
struct StepLayout {
  std::vector<int64_t> output_shape;  // the query's
  DType output_dtype = DType::kF32;   // the query's
  bool need_weights = false;

  static StepLayout Of(const StepParams& params);
};
// The step's output (in the query's dtype and shape) and weights ([1, T, K']
// or [T, K'] like the query).
// The shape of a step's weights: [1, T, K'] or [T, K'] for K' keys.
std::vector<int64_t> StepWeightsShape(const StepLayout& layout, int64_t keys);
void EncodeAppendResult(const StepLayout& layout, const StepResult& result,
                        v1::AppendResponse* out);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_SESSION_CODEC_H_
