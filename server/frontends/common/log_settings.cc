#include "server/frontends/common/log_settings.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/observability/logger.h"

namespace mha::server {
namespace {

using LogValue = inference::LogSettingsRequest::SettingValue;

absl::Status WrongLogSettingType(const std::string& name, const char* wanted) {
  return absl::InvalidArgumentError(
      absl::StrCat("log setting '", name, "' takes a ", wanted, " value"));
}

absl::Status SetLogSwitch(const std::string& name, const LogValue& value, bool* out) {
  if (value.parameter_choice_case() != LogValue::kBoolParam)
    return WrongLogSettingType(name, "boolean");
  *out = value.bool_param();
  return absl::OkStatus();
}

// One setting of `request` onto `settings`.
absl::Status ApplyLogSetting(const std::string& name, const LogValue& value,
                             LogSettings& settings) {
  if (name == "log_info") return SetLogSwitch(name, value, &settings.info);
  if (name == "log_warnings") return SetLogSwitch(name, value, &settings.warning);
  if (name == "log_errors") return SetLogSwitch(name, value, &settings.error);
  if (name == "log_verbose_level") {
    if (value.parameter_choice_case() != LogValue::kUint32Param)
      return WrongLogSettingType(name, "uint32");
    settings.verbose_level = value.uint32_param();
    return absl::OkStatus();
  }
  if (name == "log_format") {
    if (value.parameter_choice_case() != LogValue::kStringParam)
      return WrongLogSettingType(name, "string");
    absl::StatusOr<LogFormat> format = ParseLogFormat(value.string_param());
    if (!format.ok()) return format.status();
    settings.format = *format;
    return absl::OkStatus();
  }
  if (name == "log_file") {
    if (value.parameter_choice_case() != LogValue::kStringParam)
      return WrongLogSettingType(name, "string");
    if (value.string_param() != settings.file) {
      return absl::InvalidArgumentError(
          "log_file is set at start (--log_file) and cannot be changed over the network");
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown log setting '", name,
      "' (log_file, log_info, log_warnings, log_errors, log_verbose_level, log_format)"));
}

}  // namespace

absl::Status ApplyLogSettings(const inference::LogSettingsRequest& request,
                              inference::LogSettingsResponse* response) {
  LogSettings settings = CurrentLogSettings();
  if (!request.settings().empty()) {
    for (const auto& [name, value] : request.settings()) {
      if (absl::Status s = ApplyLogSetting(name, value, settings); !s.ok()) return s;
    }
    if (absl::Status s = ConfigureLogging(settings); !s.ok()) return s;
    auto word = [](bool on) { return on ? "true" : "false"; };
    LogInfo(absl::StrCat(
        "log settings changed: log_format=", LogFormatName(settings.format),
        " log_info=", word(settings.info), " log_warnings=", word(settings.warning),
        " log_errors=", word(settings.error), " log_verbose_level=", settings.verbose_level));
  }
  auto& out = *response->mutable_settings();
  out["log_file"].set_string_param(settings.file);
  out["log_info"].set_bool_param(settings.info);
  out["log_warnings"].set_bool_param(settings.warning);
  out["log_errors"].set_bool_param(settings.error);
  out["log_verbose_level"].set_uint32_param(settings.verbose_level);
  out["log_format"].set_string_param(std::string(LogFormatName(settings.format)));
  return absl::OkStatus();
}

}  // namespace mha::server
