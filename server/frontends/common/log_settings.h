// Triton's logging extension, for both doors: applies a LogSettingsRequest
// to the process's logger (server/observability/logger.h) and reads its
// settings back by Triton's names. The HTTP route (/v2/logging) converts its
// JSON object to and from these messages.
#ifndef MHA_SERVER_FRONTENDS_COMMON_LOG_SETTINGS_H_
#define MHA_SERVER_FRONTENDS_COMMON_LOG_SETTINGS_H_

#include "absl/status/status.h"
#include "inference/grpc_service.pb.h"

namespace mha::server {

// Applies every setting of `request`, or none: an unknown name, a value of
// the wrong type, an unknown log_format, or a log_file other than the one in
// use (a network client must not make the server write where it chooses; as
// Triton) is INVALID_ARGUMENT naming it. Then fills `response` with every
// setting. Thread-safe.
absl::Status ApplyLogSettings(const inference::LogSettingsRequest& request,
                              inference::LogSettingsResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_COMMON_LOG_SETTINGS_H_
