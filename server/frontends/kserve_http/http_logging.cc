#include "server/frontends/kserve_http/http_logging.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/frontends/kserve_http/http_infer_codec.h"
#include "server/frontends/kserve_http/http_routes.h"

namespace mha::server {
namespace {

using nlohmann::json;

// The POST body's settings as LogSettings' request.
absl::Status ReadLogSettings(const HttpRequest& request, inference::LogSettingsRequest* out) {
  if (request.body.empty()) return absl::OkStatus();
  absl::StatusOr<json> body = ParseJson(request.body, "request body");
  if (!body.ok()) return body.status();
  if (!body->is_object()) return absl::InvalidArgumentError("request body: expected a JSON object");
  for (const auto& [name, value] : body->items()) {
    inference::LogSettingsRequest::SettingValue& setting = (*out->mutable_settings())[name];
    if (value.is_boolean()) {
      setting.set_bool_param(value.get<bool>());
    } else if (value.is_number_unsigned() &&
               value.get<uint64_t>() <= std::numeric_limits<uint32_t>::max()) {
      setting.set_uint32_param(static_cast<uint32_t>(value.get<uint64_t>()));
    } else if (value.is_string()) {
      setting.set_string_param(value.get<std::string>());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "log setting '", name, "': expected a boolean, an integer from 0 to 2^32-1 or a string"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

HttpResponse LoggingAnswer(const KserveCalls& calls, const HttpRequest& request) {
  inference::LogSettingsRequest in;
  if (request.method == "POST") {
    if (absl::Status read = ReadLogSettings(request, &in); !read.ok()) return HttpError(read);
  }
  inference::LogSettingsResponse out;
  if (absl::Status s = calls.LogSettings(request.Header("authorization"), in, &out); !s.ok()) {
    return HttpError(s);
  }
  json body = json::object();
  for (const auto& [name, value] : out.settings()) {
    switch (value.parameter_choice_case()) {
      case inference::LogSettingsResponse::SettingValue::kBoolParam:
        body[name] = value.bool_param();
        break;
      case inference::LogSettingsResponse::SettingValue::kUint32Param:
        body[name] = value.uint32_param();
        break;
      default:
        body[name] = value.string_param();
    }
  }
  HttpResponse response;
  response.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return response;
}

}  // namespace mha::server
