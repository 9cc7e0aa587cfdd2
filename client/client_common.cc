#include "client/client_common.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/file_read.h"
#include "engine/tensor.h"

namespace mha::client {

double Milliseconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ConnectionOptions& o) {
  grpc::ChannelArguments args;
  const int limit = static_cast<int>(std::min<int64_t>(o.max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  if (!o.tls) return grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args);
  grpc::SslCredentialsOptions ssl;
  for (const auto& [path, field] :
       {std::pair{o.ca_file, &ssl.pem_root_certs}, std::pair{o.cert_file, &ssl.pem_cert_chain},
        std::pair{o.key_file, &ssl.pem_private_key}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> text = ReadWholeFile(path);
    if (!text.ok()) return text.status();
    *field = *std::move(text);
  }
  return grpc::CreateCustomChannel(o.target, grpc::SslCredentials(ssl), args);
}

absl::Status CheckShapeFlags(int64_t batch, int64_t len, int64_t kv_len) {
  for (const auto& [name, value, least] : {std::tuple{"batch", batch, 1}, std::tuple{"len", len, 1},
                                           std::tuple{"kv_len", kv_len, 0}}) {
    if (value < least) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": at least ", least, ", got ", value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRequestBytes(double bytes, int64_t client_limit, int64_t server_limit,
                               absl::string_view smaller) {
  const bool over_client = bytes > static_cast<double>(client_limit);
  const bool over_server = server_limit > 0 && bytes > static_cast<double>(server_limit);
  if (!over_client && !over_server) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "the request would be about %.0f bytes: more than %s (this client's --max_message_bytes is "
      "%d, the server's --max_message_bytes %s); %s",
      bytes,
      over_client && over_server ? "both limits"
      : over_client              ? "this client sends"
                                 : "the server takes",
      client_limit,
      server_limit > 0 ? absl::StrCat("is ", server_limit) : std::string("is not known"), smaller));
}

std::string CountsJson(const std::map<std::string, int64_t>& counts) {
  std::string members;
  for (const auto& [name, count] : counts) {
    absl::StrAppend(&members, members.empty() ? "" : ", ", "\"", name, "\": ", count);
  }
  return members;
}

void AddToken(const std::string& token, grpc::ClientContext& context) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

v1::Tensor RandomTensor(const std::vector<int64_t>& shape, std::mt19937& gen) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.0f, 0.5f);
  std::vector<float> values(n);
  for (float& v : values) v = dist(gen);
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FP32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  return t;
}

std::string CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c <= 16 ? kNames[c] : "UNKNOWN";
}

int ReportError(const grpc::Status& status) {
  std::fprintf(stderr, "%s: %s\n", CodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return 1;
}

std::string ShapeText(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

std::vector<float> TensorValues(const v1::Tensor& t) {
  std::vector<float> values;
  if (t.dtype() == v1::DATA_TYPE_FP32) {
    values.resize(t.data().size() / 4);
    std::memcpy(values.data(), t.data().data(), values.size() * 4);
    return values;
  }
  values.resize(t.data().size() / 2);
  ConvertToFloat(t.dtype() == v1::DATA_TYPE_BF16 ? DType::kBF16 : DType::kF16,
                 reinterpret_cast<const uint8_t*>(t.data().data()),
                 static_cast<int64_t>(values.size()), values.data());
  return values;
}

}  // namespace mha::client
