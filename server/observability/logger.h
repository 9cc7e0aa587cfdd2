// The server's one logger: every line mha_server writes about what it does
// goes through here, with a level, a timestamp, the thread and, where a
// request is known, its trace id (no caller has one yet: requests are not
// traced so far). Text by default (Triton's layout), ISO 8601
// timestamps or JSON lines on request; to stderr or to a file. The settings
// are Triton's logging extension's (LogSettings over gRPC, /v2/logging over
// HTTP) and change at run time. Built on spdlog (Debian's libspdlog-dev):
// its sinks write each line whole from many threads; its file sink appends,
// and makes the file's folder when missing.
// (The "mha_server ready ..." line on stdout is a contract for scripts, not a
// log line; flag errors before start-up are the CLI's "CODE: message".)
#ifndef MHA_SERVER_OBSERVABILITY_LOGGER_H_
#define MHA_SERVER_OBSERVABILITY_LOGGER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::server {

enum class LogFormat {
  kDefault,  // I1202 14:05:01.123456 4711] message
  kIso8601,  // 2026-12-02T14:05:01Z I 4711] message
  kJson,     // {"time":"2026-12-02T14:05:01.123456Z","level":"INFO",...}
};

// Triton's names: log_file ("" is stderr), log_info, log_warning, log_error,
// log_verbose_level (0: no verbose lines), log_format.
struct LogSettings {
  std::string file;
  bool info = true;
  bool warning = true;
  bool error = true;
  uint32_t verbose_level = 0;
  LogFormat format = LogFormat::kDefault;
};

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);  // default, ISO8601, json
absl::string_view LogFormatName(LogFormat format);

// Applies `settings` to the process's logger. A file that cannot be opened
// is INVALID_ARGUMENT and changes nothing. Thread-safe.
absl::Status ConfigureLogging(const LogSettings& settings);
LogSettings CurrentLogSettings();

// One line each; `trace_id` (32 hex digits) is added when not empty.
// Thread-safe; a line a setting turns off costs one atomic load.
void LogError(absl::string_view message, absl::string_view trace_id = {});
void LogWarning(absl::string_view message, absl::string_view trace_id = {});
void LogInfo(absl::string_view message, absl::string_view trace_id = {});
void LogVerbose(uint32_t level, absl::string_view message, absl::string_view trace_id = {});
bool VerboseLogging(uint32_t level);  // whether LogVerbose(level, ...) writes

}  // namespace mha::server

#endif  // MHA_SERVER_OBSERVABILITY_LOGGER_H_
