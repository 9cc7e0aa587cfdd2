// RESOURCE_EXHAUSTED comes in two kinds that a client must treat apart: the
// request, or its answer, is larger than a limit (no retry of the same
// request can pass), or a queue or budget is full now (a retry later may).
// gRPC has one code for both; the first kind carries a payload that says
// so, and HTTP answers it 413 (the second 503).
#ifndef MHA_ENGINE_TOO_LARGE_H_
#define MHA_ENGINE_TOO_LARGE_H_

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace mha {

inline constexpr char kTooLargePayload[] = "type.mha-serve/TooLarge";

// RESOURCE_EXHAUSTED with `message`, marked as larger than a limit.
inline absl::Status TooLargeError(absl::string_view message) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kTooLargePayload, absl::Cord("1"));
  return status;
}

// Whether `status` is a TooLargeError (a refusal that no retry passes).
inline bool IsTooLarge(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kTooLargePayload).has_value();
}

}  // namespace mha

#endif  // MHA_ENGINE_TOO_LARGE_H_
