// The closed-loop load generator behind `mha_client load`.
#ifndef MHA_CLIENT_LOAD_GENERATOR_H_
#define MHA_CLIENT_LOAD_GENERATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace mha::client {

struct LoadOptions {
  std::string model = "demo";
  int concurrency = 1;          // requests in flight at all times
  absl::Duration duration = absl::Seconds(5);
  int64_t max_requests = 0;     // 0: until duration
  int64_t min_len = 16, max_len = 16;  // query length, uniform
  int64_t embed_dim = 256;
  int64_t kv_len = 0;           // > 0: cross-attention with this key length
  uint32_t seed = 1;
};

struct LoadReport {
  int64_t requests = 0, tokens = 0;
  std::map<std::string, int64_t> errors;  // by status code name
  double seconds = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, p999_ms = 0, max_ms = 0;

  double rps() const { return seconds > 0 ? requests / seconds : 0; }
  std::string Text() const;
  std::string Json() const;
};

// Keeps `concurrency` Attend calls in flight on one channel (callback API,
// no thread per request) until the duration or request count is reached.
LoadReport RunLoad(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& options);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_GENERATOR_H_
