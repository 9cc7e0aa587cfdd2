// What every transport sends beside an answer, under the same names (gRPC
// trailing metadata, HTTP headers), and the one way a status becomes the
// message a client reads.
#ifndef MHA_SERVER_FRONTENDS_COMMON_ANSWER_METADATA_H_
#define MHA_SERVER_FRONTENDS_COMMON_ANSWER_METADATA_H_

#include <string>

#include "absl/status/status.h"

namespace mha::server {

// Microseconds from handler in to response out, on every attention answer.
inline constexpr char kServerTimeMetadata[] = "mha-server-time-us";
// And of a computed request: microseconds of the engine call that computed
// it (what mha_compute_duration_seconds observes), so that a client can
// tell its call's compute from the rest.
inline constexpr char kComputeTimeMetadata[] = "mha-compute-time-us";

// `status`'s message, or its code's name when it has none (no error leaves
// without a message: Triton's C++ client takes an empty one for success).
std::string MessageOf(const absl::Status& status);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_COMMON_ANSWER_METADATA_H_
