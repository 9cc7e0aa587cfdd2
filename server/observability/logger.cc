#include "server/observability/logger.h"

#include <atomic>
#include <chrono>
#include <ctime>
#include <iterator>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/mutex.h"
#include "spdlog/formatter.h"
#include "spdlog/logger.h"
#include "spdlog/sinks/basic_file_sink.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace mha::server {
namespace {

// The trace id of the line being written: set around the synchronous
// spdlog call, read by the formatter on the same thread.
thread_local absl::string_view line_trace_id;

// Appends `text` to `out` as the inside of a JSON string.
void AppendJsonEscaped(absl::string_view text, spdlog::memory_buf_t& out) {
  for (const char c : text) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      case '\r':
        out.append(std::string_view("\\r"));
        break;
      case '\t':
        out.append(std::string_view("\\t"));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out.push_back(c);
        }
    }
  }
}

// Formats each line in the configured layout, in UTC (containers have no
// time zone; a line's time must not depend on the host's).
class LineFormatter : public spdlog::formatter {
 public:
  explicit LineFormatter(LogFormat format) : format_(format) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t seconds =
        std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const long micros = static_cast<long>(
        std::chrono::duration_cast<std::chrono::microseconds>(since_epoch).count() % 1000000);
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    const absl::string_view message(msg.payload.data(), msg.payload.size());
    auto out = std::back_inserter(dest);
    switch (format_) {
      case LogFormat::kDefault:
        fmt::format_to(out, "{}{:02}{:02} {:02}:{:02}:{:02}.{:06} {}] ", Letter(msg.level),
                       utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, micros,
                       msg.thread_id);
        break;
      case LogFormat::kIso8601:
        fmt::format_to(out, "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z {} {}] ", utc.tm_year + 1900,
                       utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                       Letter(msg.level), msg.thread_id);
        break;
      case LogFormat::kJson:
        fmt::format_to(out,
                       "{{\"time\":\"{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z\",\"level\":\"{}\","
                       "\"thread\":{},\"message\":\"",
                       utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
                       utc.tm_sec, micros, LevelName(msg.level), msg.thread_id);
        AppendJsonEscaped(message, dest);
        dest.push_back('"');
        if (!line_trace_id.empty()) {
          dest.append(std::string_view(",\"trace_id\":\""));
          AppendJsonEscaped(line_trace_id, dest);
          dest.push_back('"');
        }
        dest.append(std::string_view("}\n"));
        return;
    }
    dest.append(message.data(), message.data() + message.size());
    if (!line_trace_id.empty())
      fmt::format_to(out, " trace_id={}",
                     std::string_view(line_trace_id.data(), line_trace_id.size()));
    dest.push_back('\n');
  }

  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<LineFormatter>(format_);
  }

 private:
  // Triton's letters; its verbose lines are I too.
  static char Letter(spdlog::level::level_enum level) {
    if (level == spdlog::level::err) return 'E';
    if (level == spdlog::level::warn) return 'W';
    return 'I';
  }
  static const char* LevelName(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::err:
        return "ERROR";
      case spdlog::level::warn:
        return "WARNING";
      case spdlog::level::debug:
        return "VERBOSE";
      default:
        return "INFO";
    }
  }

  const LogFormat format_;
};

// Owns the spdlog logger of the current settings (replaced whole when they
// change) and the level switches every line reads. Thread-safe.
class ProcessLogger {
 public:
  ProcessLogger() : logger_(Make(LogSettings{}).value()) {}

  bool On(spdlog::level::level_enum level, uint32_t verbose = 0) const {
    switch (level) {
      case spdlog::level::err:
        return error_.load(std::memory_order_relaxed);
      case spdlog::level::warn:
        return warning_.load(std::memory_order_relaxed);
      case spdlog::level::info:
        return info_.load(std::memory_order_relaxed);
      default:
        return verbose != 0 && verbose <= verbose_level_.load(std::memory_order_relaxed);
    }
  }

  void Write(spdlog::level::level_enum level, absl::string_view message,
             absl::string_view trace_id) {
    std::shared_ptr<spdlog::logger> logger;
    {
      MutexLock lock(mu_);
      logger = logger_;
    }
    line_trace_id = trace_id;
    logger->log(level, spdlog::string_view_t(message.data(), message.size()));
    line_trace_id = {};
  }

  absl::Status Configure(const LogSettings& settings) {
    absl::StatusOr<std::shared_ptr<spdlog::logger>> logger = Make(settings);
    if (!logger.ok()) return logger.status();
    MutexLock lock(mu_);
    logger_ = *std::move(logger);
    settings_ = settings;
    info_ = settings.info;
    warning_ = settings.warning;
    error_ = settings.error;
    verbose_level_ = settings.verbose_level;
    return absl::OkStatus();
  }

  LogSettings Settings() const {
    MutexLock lock(mu_);
    return settings_;
  }

 private:
  static absl::StatusOr<std::shared_ptr<spdlog::logger>> Make(const LogSettings& settings) {
    std::shared_ptr<spdlog::sinks::sink> sink;
    if (settings.file.empty()) {
      sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    } else {
      try {
        sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(settings.file);
      } catch (const spdlog::spdlog_ex& e) {
        return absl::InvalidArgumentError(
            absl::StrCat("log_file '", settings.file, "' cannot be opened: ", e.what()));
      }
    }
    sink->set_formatter(std::make_unique<LineFormatter>(settings.format));
    auto logger = std::make_shared<spdlog::logger>("mha_server", std::move(sink));
    logger->set_level(spdlog::level::trace);  // the switches above filter
    logger->flush_on(spdlog::level::trace);   // each line whole, at once
    return logger;
  }

  mutable Mutex mu_;
  std::shared_ptr<spdlog::logger> logger_ ABSL_GUARDED_BY(mu_);
  LogSettings settings_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> info_{true};
  std::atomic<bool> warning_{true};
  std::atomic<bool> error_{true};
  std::atomic<uint32_t> verbose_level_{0};
};

// Never destroyed: threads may log while the process exits.
ProcessLogger& TheLogger() {
  static ProcessLogger* logger = new ProcessLogger();
  return *logger;
}

void Log(spdlog::level::level_enum level, uint32_t verbose, absl::string_view message,
         absl::string_view trace_id) {
  ProcessLogger& logger = TheLogger();
  if (logger.On(level, verbose)) logger.Write(level, message, trace_id);
}

}  // namespace

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "default" || name == "text") return LogFormat::kDefault;
  if (absl::EqualsIgnoreCase(name, "ISO8601")) return LogFormat::kIso8601;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log_format '", name, "' is not one of default, ISO8601, json"));
}

absl::string_view LogFormatName(LogFormat format) {
  switch (format) {
    case LogFormat::kIso8601:
      return "ISO8601";
    case LogFormat::kJson:
      return "json";
    default:
      return "default";
  }
}

absl::Status ConfigureLogging(const LogSettings& settings) {
  return TheLogger().Configure(settings);
}

LogSettings CurrentLogSettings() { return TheLogger().Settings(); }

void LogError(absl::string_view message, absl::string_view trace_id) {
  Log(spdlog::level::err, 0, message, trace_id);
}
void LogWarning(absl::string_view message, absl::string_view trace_id) {
  Log(spdlog::level::warn, 0, message, trace_id);
}
void LogInfo(absl::string_view message, absl::string_view trace_id) {
  Log(spdlog::level::info, 0, message, trace_id);
}
void LogVerbose(uint32_t level, absl::string_view message, absl::string_view trace_id) {
  Log(spdlog::level::debug, level, message, trace_id);
}
bool VerboseLogging(uint32_t level) { return TheLogger().On(spdlog::level::debug, level); }

}  // namespace mha::server
