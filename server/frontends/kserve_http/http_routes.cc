#include "server/frontends/kserve_http/http_routes.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/status_macros.h"
#include "engine/too_large.h"
#include "google/protobuf/util/json_util.h"
#include "server/frontends/common/answer_metadata.h"
#include "server/frontends/common/kserve_codec.h"
#include "server/frontends/kserve_http/http_infer_codec.h"
#include "server/frontends/kserve_http/http_logging.h"
#include "server/observability/metrics.h"
#include "wire/wire_writer.h"

namespace mha::server {
namespace {

using nlohmann::json;

HttpResponse JsonAnswer(const json& body) {
  HttpResponse r;
  r.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return r;
}

HttpResponse Answer(const absl::Status& status,
                    const google::protobuf::Message* message = nullptr) {
  if (!status.ok()) return HttpError(status);
  return message == nullptr ? HttpResponse{} : JsonAnswer(MessageToJson(*message));
}

HttpResponse MethodNotAllowed(const HttpRequest& request, const char* allowed) {
  HttpResponse r =
      JsonAnswer(json{{"error", absl::StrCat("method ", request.method, " is not served on ",
                                             request.path, " (", allowed, " is)")}});
  r.status = 405;
  r.headers.emplace_back("Allow", allowed);
  return r;
}

// An optional JSON object body ("" is {}).
absl::StatusOr<json> BodyObject(const HttpRequest& request) {
  if (request.body.empty()) return json::object();
  absl::StatusOr<json> body = ParseJson(request.body, "request body");
  if (body.ok() && !body->is_object())
    return absl::InvalidArgumentError("request body: expected a JSON object");
  return body;
}

bool AcceptsGzip(const HttpRequest& request) {
  for (absl::string_view coding : absl::StrSplit(request.Header("accept-encoding"), ',')) {
    coding = absl::StripAsciiWhitespace(coding);
    if (absl::StartsWith(coding, "gzip") && !absl::StrContains(coding, "q=0")) return true;
  }
  return false;
}

// The repository load and unload parameters of Triton's HTTP API: "config"
// (a JSON string), "file:<path>" (base64 of the file's bytes),
// "unload_dependents" (bool).
absl::Status ReadRepositoryParameters(
    const json& body,
    google::protobuf::Map<std::string, inference::ModelRepositoryParameter>* out) {
  auto it = body.find("parameters");
  if (it == body.end()) return absl::OkStatus();
  if (!it->is_object()) return absl::InvalidArgumentError("\"parameters\" must be an object");
  for (const auto& [name, value] : it->items()) {
    inference::ModelRepositoryParameter& p = (*out)[name];
    if (value.is_boolean()) {
      p.set_bool_param(value.get<bool>());
    } else if (value.is_number_integer()) {
      p.set_int64_param(value.get<int64_t>());
    } else if (value.is_string() && absl::StartsWith(name, "file:")) {
      std::string bytes;
      if (!absl::Base64Unescape(value.get<std::string>(), &bytes)) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": not base64"));
      }
      p.set_bytes_param(std::move(bytes));
    } else if (value.is_string()) {
      p.set_string_param(value.get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\": expected a bool, an integer or a string"));
    }
  }
  return absl::OkStatus();
}

// What an infer call needs beyond the KServe message: kept together so
// that the call's base can be given the message before the call exists.
struct HttpInferState {
  // Its binary inputs are views of the request's body, which the
  // connection holds until `respond` has answered (respond holds it).
  HttpInferRequest request;
  RawReceived raw;  // request.in_body, as KserveInferCall reads it
  inference::ModelInferResponse response;
  std::string authorization;
  bool gzip = false;
  HttpRespond respond;
};

// A KServe infer call answered over HTTP: the same call as gRPC's
// ModelInfer, with Triton's HTTP body as its encoding.
class HttpInferCall final : public KserveInferCall {
 public:
  HttpInferCall(std::unique_ptr<HttpInferState> state, const KserveCalls& calls)
      : KserveInferCall(state->request.message, &state->response, calls), state_(std::move(state)) {
    if (sequence_parameters() != nullptr) {  // its step reads the message
      state_->request.Materialize();
      return;
    }
    for (const auto& pieces : state_->request.in_body) {
      state_->raw.push_back(pieces.empty() ? nullptr : &pieces);
    }
    SetReceived(&state_->raw);
    DeferOutputs(&deferred_);
  }

  absl::string_view Authorization() const override { return state_->authorization; }

 private:
  bool SendsConvertedOutput() const override { return true; }  // EncodeResult

  // Large F32 outputs stay where the engine wrote them, and large FP16 or
  // BF16 ones where the worker converted them (`views_`, their owner held
  // until sent, as WireWriter's views); others are written into the
  // response's raw entries.
  absl::Status EncodeResult(const ModelVersion& model, const ResultLayout& layout,
                            const AttentionResult& result) override {
    deferred_.clear();
    views_.clear();
    RETURN_IF_ERROR(KserveInferCall::EncodeResult(model, layout, result));
    for (DeferredOutput& out : deferred_) {
      if (IsConvertedFrom(out.converted, out.values, out.dtype) ||
          (out.dtype == DType::kF32 && out.owner != nullptr &&
           out.values.size() * sizeof(float) >= wire::kViewMinBytes)) {
        views_.push_back(std::move(out));
      } else {
        EncodeBytes(out.values, out.dtype,
                    *state_->response.mutable_raw_output_contents(out.raw_index));
      }
    }
    deferred_.clear();
    return absl::OkStatus();
  }
  void Send(const absl::Status& status, absl::Duration took) override {
    HttpResponse out;
    absl::StatusOr<HttpInferBody> body =
        status.ok() ? EncodeHttpInfer(state_->response, state_->request, views_) : status;
    if (!body.ok()) {
      out = HttpError(body.status());
    } else {
      out.body = std::move(body->body);
      out.tail = std::move(body->binary);
      if (body->header_length.has_value()) {
        out.content_type = "application/octet-stream";
        out.headers.emplace_back("Inference-Header-Content-Length",
                                 absl::StrCat(*body->header_length));
      }
      size_t size = out.body.size();
      for (const HttpBytes& part : out.tail) size += part.bytes().size();
      if (state_->gzip && size > 1024) {  // compressed whole
        for (const HttpBytes& part : out.tail) absl::StrAppend(&out.body, part.bytes());
        out.tail.clear();
        out.body = GzipOf(out.body);
        out.headers.emplace_back("Content-Encoding", "gzip");
      }
    }
    out.headers.emplace_back(kServerTimeMetadata, absl::StrCat(absl::ToInt64Microseconds(took)));
    if (compute_time > absl::ZeroDuration()) {
      out.headers.emplace_back(kComputeTimeMetadata,
                               absl::StrCat(absl::ToInt64Microseconds(compute_time)));
    }
    state_->respond(std::move(out));
  }
  void Hold(std::shared_ptr<MemoryReservation> memory) override { memory_ = std::move(memory); }

  const std::unique_ptr<HttpInferState> state_;
  std::shared_ptr<MemoryReservation> memory_;
  std::vector<DeferredOutput> deferred_, views_;
};

}  // namespace

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kResourceExhausted:
      return IsTooLarge(status) ? 413 : 503;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      return 500;
    default:
      return 400;
  }
}

HttpResponse HttpError(const absl::Status& status) {
  HttpResponse r = JsonAnswer(json{{"error", MessageOf(status)}});
  r.status = HttpStatusOf(status);
  r.headers.emplace_back(kStatusCodeHeader, absl::StatusCodeToString(status.code()));
  if (r.status == 503) r.headers.emplace_back("Retry-After", "1");
  return r;
}

void KserveHttpRoutes::Handle(const HttpRequest& request, HttpRespond respond) {
  const std::vector<std::string> s = absl::StrSplit(request.path, '/', absl::SkipEmpty());
  const bool get = request.method == "GET" || request.method == "HEAD";
  const bool post = request.method == "POST";
  auto only = [&](bool allowed, const char* method) {
    if (!allowed) respond(MethodNotAllowed(request, method));
    return allowed;
  };
  if (s.empty() || s[0] != "v2") {
    return respond(HttpError(
        absl::NotFoundError(absl::StrCat("no route ", request.path, " (the API is under /v2)"))));
  }
  const absl::string_view authorization = request.Header("authorization");
  if (s.size() == 1) {
    if (!only(get, "GET")) return;
    inference::ServerMetadataResponse metadata;
    return respond(Answer(calls_.ServerMetadata(authorization, &metadata), &metadata));
  }
  if (s[1] == "health" && s.size() == 3 && (s[2] == "live" || s[2] == "ready")) {
    if (!only(get, "GET")) return;
    const bool ok = s[2] == "live" || calls_.Ready();
    return respond(ok ? HttpResponse{}
                      : HttpError(absl::InvalidArgumentError("server is not ready (draining)")));
  }
  if (s[1] == "models" && s.size() >= 3) {
    return HandleModel(request, std::vector<std::string>(s.begin() + 2, s.end()), respond);
  }
  if (s[1] == "repository" && s.size() >= 3) {
    if (!only(post, "POST")) return;
    return HandleRepository(request, std::vector<std::string>(s.begin() + 2, s.end()), respond);
  }
  if (s[1] == "logging" && s.size() == 2) {
    if (!only(get || post, "GET, POST")) return;
    return respond(LoggingAnswer(calls_, request));
  }
  if (s[1] == "systemsharedmemory" || s[1] == "cudasharedmemory") {
    return HandleSharedMemory(request, std::vector<std::string>(s.begin() + 2, s.end()),
                              s[1] == "cudasharedmemory", respond);
  }
  respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
}

void KserveHttpRoutes::HandleModel(const HttpRequest& request, const std::vector<std::string>& s,
                                   HttpRespond& respond) {
  const absl::string_view authorization = request.Header("authorization");
  const bool get = request.method == "GET" || request.method == "HEAD";
  if (s.size() == 1 && s[0] == "stats") {  // every model's
    if (!get) return respond(MethodNotAllowed(request, "GET"));
    inference::ModelStatisticsResponse stats;
    return respond(Answer(calls_.ModelStatistics(authorization, {}, &stats), &stats));
  }
  const std::string& model = s[0];
  std::string version;
  size_t next = 1;
  if (s.size() >= 3 && s[1] == "versions") {
    version = s[2];
    next = 3;
  }
  if (s.size() > next + 1 || (s.size() == 2 && s[1] == "versions")) {
    return respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
  }
  const std::string verb = s.size() == next + 1 ? s[next] : "";
  if (verb == "infer") {
    if (request.method != "POST") return respond(MethodNotAllowed(request, "POST"));
    return Infer(request, model, version, std::move(respond));
  }
  if (!get) return respond(MethodNotAllowed(request, "GET"));
  if (verb.empty()) {
    inference::ModelMetadataRequest in;
    in.set_name(model);
    in.set_version(version);
    inference::ModelMetadataResponse out;
    return respond(Answer(calls_.ModelMetadata(authorization, in, &out), &out));
  }
  if (verb == "ready") {
    inference::ModelReadyRequest in;
    in.set_name(model);
    in.set_version(version);
    inference::ModelReadyResponse out;
    const absl::Status status = calls_.ModelReady(in, &out);
    if (!status.ok()) return respond(HttpError(status));
    return respond(out.ready() ? HttpResponse{}
                               : HttpError(absl::InvalidArgumentError(
                                     absl::StrCat("model '", model, "' is not ready"))));
  }
  if (verb == "config") {
    inference::ModelConfigRequest in;
    in.set_name(model);
    in.set_version(version);
    inference::ModelConfigResponse out;
    if (absl::Status status = calls_.ModelConfig(authorization, in, &out); !status.ok()) {
      return respond(HttpError(status));
    }
    // As Triton: the config itself, in protobuf's JSON mapping.
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    options.always_print_primitive_fields = true;
    HttpResponse r;
    (void)google::protobuf::util::MessageToJsonString(out.config(), &r.body, options);
    return respond(std::move(r));
  }
  if (verb == "stats") {
    inference::ModelStatisticsRequest in;
    in.set_name(model);
    in.set_version(version);
    inference::ModelStatisticsResponse out;
    return respond(Answer(calls_.ModelStatistics(authorization, in, &out), &out));
  }
  respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
}

void KserveHttpRoutes::Infer(const HttpRequest& request, const std::string& model,
                             const std::string& version, HttpRespond respond) {
  // A request refused here is counted as a call's refusal is (gRPC's are
  // refused, and counted, past the gate).
  auto refuse = [&](const absl::Status& status) {
    absl::StatusOr<int64_t> number = ParseModelVersion(model, version);
    calls_.gate().CountRefused(model, number.value_or(0), kApiKserveHttp, status.code());
    respond(HttpError(status));
  };
  std::optional<size_t> header_length;
  if (const absl::string_view h = request.Header("inference-header-content-length"); !h.empty()) {
    size_t n = 0;
    if (!absl::SimpleAtoi(h, &n)) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("Inference-Header-Content-Length '", h, "' is not a byte count")));
    }
    header_length = n;
  }
  int64_t raw_query_width = 0;
  if (header_length == 0 || request.body.empty()) {
    // The query's width from the model's metadata (Triton's raw form, or
    // the error of an empty body); NOT_FOUND for a model not served.
    inference::ModelMetadataRequest in;
    in.set_name(model);
    in.set_version(version);
    inference::ModelMetadataResponse out;
    const absl::Status found = calls_.ModelMetadata(request.Header("authorization"), in, &out);
    if (!found.ok()) return refuse(found);
    for (const auto& input : out.inputs()) {
      if (input.name() == "query" && input.shape_size() > 0) {
        raw_query_width = input.shape(input.shape_size() - 1);
      }
    }
  }
  if (request.body.empty() && header_length != 0) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "no inference header: the body is empty. Send the JSON inference request (with "
        "Inference-Header-Content-Length: its bytes when binary data follows it), or, with "
        "Inference-Header-Content-Length: 0, one FP32 query [1, L, ",
        raw_query_width, "] as the body")));
  }
  absl::StatusOr<HttpInferRequest> decoded =
      DecodeHttpInfer(request.body, header_length, model, version, raw_query_width);
  if (!decoded.ok()) return refuse(decoded.status());
  auto state = std::make_unique<HttpInferState>();
  state->request = *std::move(decoded);
  state->authorization = std::string(request.Header("authorization"));
  state->gzip = AcceptsGzip(request);
  state->respond = std::move(respond);
  calls_.StartInfer(std::make_unique<HttpInferCall>(std::move(state), calls_), kApiKserveHttp);
}

void KserveHttpRoutes::HandleRepository(const HttpRequest& request,
                                        const std::vector<std::string>& s, HttpRespond& respond) {
  const std::string authorization(request.Header("authorization"));
  absl::StatusOr<json> body = BodyObject(request);
  if (!body.ok()) return respond(HttpError(body.status()));
  if (s.size() == 1 && s[0] == "index") {
    inference::RepositoryIndexRequest in;
    if (auto it = body->find("ready"); it != body->end() && it->is_boolean()) {
      in.set_ready(it->get<bool>());
    }
    inference::RepositoryIndexResponse out;
    const absl::Status status = calls_.RepositoryIndex(authorization, in, &out);
    if (!status.ok()) return respond(HttpError(status));
    json models = json::array();  // Triton answers the list itself
    for (const auto& m : out.models()) models.push_back(MessageToJson(m));
    return respond(JsonAnswer(models));
  }
  if (s.size() != 3 || s[0] != "models" || (s[2] != "load" && s[2] != "unload")) {
    return respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
  }
  auto done = [respond](const absl::Status& status) { respond(Answer(status)); };
  if (s[2] == "load") {
    auto in = std::make_shared<inference::RepositoryModelLoadRequest>();
    in->set_model_name(s[1]);
    if (absl::Status status = ReadRepositoryParameters(*body, in->mutable_parameters());
        !status.ok()) {
      return respond(HttpError(status));
    }
    // The request lives until the load has answered (its files are viewed).
    return calls_.RepositoryModelLoad(authorization, *in,
                                      [in, done](const absl::Status& status) { done(status); });
  }
  inference::RepositoryModelUnloadRequest in;
  in.set_model_name(s[1]);
  if (absl::Status status = ReadRepositoryParameters(*body, in.mutable_parameters());
      !status.ok()) {
    return respond(HttpError(status));
  }
  calls_.RepositoryModelUnload(authorization, in, done);
}

void KserveHttpRoutes::HandleSharedMemory(const HttpRequest& request,
                                          const std::vector<std::string>& s, bool cuda,
                                          HttpRespond& respond) {
  const absl::string_view authorization = request.Header("authorization");
  std::string region;
  size_t next = 0;
  if (s.size() >= 2 && s[0] == "region") {
    region = s[1];
    next = 2;
  }
  if (s.size() != next + 1) {
    return respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
  }
  const std::string& verb = s[next];
  const bool get = request.method == "GET" || request.method == "HEAD";
  if (verb == "status") {
    if (!get) return respond(MethodNotAllowed(request, "GET"));
    if (cuda) {
      inference::CudaSharedMemoryStatusRequest in;
      in.set_name(region);
      const absl::Status status = calls_.CudaSharedMemoryStatus(authorization, in);
      return respond(status.ok() ? JsonAnswer(json::array()) : HttpError(status));
    }
    inference::SystemSharedMemoryStatusRequest in;
    in.set_name(region);
    inference::SystemSharedMemoryStatusResponse out;
    const absl::Status status = calls_.SystemSharedMemoryStatus(authorization, in, &out);
    if (!status.ok()) return respond(HttpError(status));
    json regions = json::array();  // Triton answers the list of regions
    for (const auto& [name, r] : out.regions()) regions.push_back(MessageToJson(r));
    return respond(JsonAnswer(regions));
  }
  if (verb != "register" && verb != "unregister") {
    return respond(HttpError(absl::NotFoundError(absl::StrCat("no route ", request.path))));
  }
  if (request.method != "POST") return respond(MethodNotAllowed(request, "POST"));
  if (verb == "unregister") {
    if (cuda) return respond(Answer(calls_.CudaSharedMemoryUnregister(authorization)));
    inference::SystemSharedMemoryUnregisterRequest in;
    in.set_name(region);
    return respond(Answer(calls_.SystemSharedMemoryUnregister(authorization, in)));
  }
  if (cuda) return respond(Answer(calls_.CudaSharedMemoryRegister(authorization)));
  if (region.empty()) {
    return respond(HttpError(
        absl::NotFoundError("register needs /v2/systemsharedmemory/region/<name>/register")));
  }
  absl::StatusOr<json> body = BodyObject(request);
  if (!body.ok()) return respond(HttpError(body.status()));
  inference::SystemSharedMemoryRegisterRequest in;
  in.set_name(region);
  const json& b = *body;
  if (!b.contains("key") || !b["key"].is_string() || !b.contains("byte_size") ||
      !b["byte_size"].is_number_unsigned() ||
      (b.contains("offset") && !b["offset"].is_number_unsigned())) {
    return respond(HttpError(absl::InvalidArgumentError(
        "register: the body needs \"key\" (string), \"byte_size\" and an optional \"offset\" "
        "(non-negative integers)")));
  }
  in.set_key(b["key"].get<std::string>());
  in.set_byte_size(b["byte_size"].get<uint64_t>());
  if (b.contains("offset")) in.set_offset(b["offset"].get<uint64_t>());
  respond(Answer(calls_.SystemSharedMemoryRegister(authorization, in)));
}

}  // namespace mha::server
