// What every mha_client subcommand shares: the channel, random tensors,
// status printing. Knows only the proto and gRPC.
#ifndef MHA_CLIENT_CLIENT_COMMON_H_
#define MHA_CLIENT_CLIENT_COMMON_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::client {

// How to reach the server.
struct ConnectionOptions {
  std::string target = "127.0.0.1:50051";
  bool tls = false;
  std::string ca_file;    // PEM roots to trust (empty: the system's)
  std::string cert_file;  // client certificate and key, for mutual TLS
  std::string key_file;
  // The largest message sent or received (gRPC's own default is 4 MiB).
  int64_t max_message_bytes = int64_t{64} << 20;
};

// Whether the random inputs' sizes make a request: B and L at least 1,
// S at least 0 (a negative size aborted the client once); the message names
// the flag.
absl::Status CheckShapeFlags(int64_t batch, int64_t len, int64_t kv_len);

// Whether a request of about `bytes` may go: INVALID_ARGUMENT naming this
// client's --max_message_bytes and the server's (0: not known) when it is
// larger than either, with `smaller` (how to send less). Checked before
// the request is built.
absl::Status CheckRequestBytes(double bytes, int64_t client_limit, int64_t server_limit,
                               absl::string_view smaller);

// A model a load goes to, with the widths its inputs need.
struct LoadTarget {
  std::string model = "demo";
  int64_t embed_dim = 256;
  int64_t kdim = 256;
  int64_t max_message_bytes = 0;  // the server's (GetModel); 0: not known
};

// A steady-clock duration in milliseconds.
double Milliseconds(std::chrono::steady_clock::duration d);

// A channel with the message-size limits the server uses; the files are
// read here. INVALID_ARGUMENT/NOT_FOUND when they cannot be.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ConnectionOptions& options);

// Adds "authorization: Bearer <token>" when a token is set.
void AddToken(const std::string& token, grpc::ClientContext& context);

// A FP32 tensor of the given shape filled with N(0, 0.5^2) values.
v1::Tensor RandomTensor(const std::vector<int64_t>& shape, std::mt19937& gen);

// "INVALID_ARGUMENT", "UNAVAILABLE", ...
std::string CodeName(grpc::StatusCode code);

// Prints "CODE: message" to stderr and returns 1 (the exit code).
int ReportError(const grpc::Status& status);

// The members of a JSON object of counts: "\"A\": 1, \"B\": 2" (no braces).
std::string CountsJson(const std::map<std::string, int64_t>& counts);

// "[2, 16, 256]".
std::string ShapeText(const v1::Tensor& t);

// The elements of a FP32/BF16/FP16 tensor as floats.
std::vector<float> TensorValues(const v1::Tensor& t);

}  // namespace mha::client

#endif  // MHA_CLIENT_CLIENT_COMMON_H_
