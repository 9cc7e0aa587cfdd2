// The closed-loop load generator behind `mha_client load`.
#ifndef MHA_CLIENT_LOAD_GENERATOR_H_
#define MHA_CLIENT_LOAD_GENERATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/client_common.h"
#include "client/load_report.h"
#include "grpcpp/grpcpp.h"

namespace mha::client {

// What `mha_client load` runs (a value; RunLoad copies it).
struct LoadOptions {
  std::vector<LoadTarget> models = {LoadTarget{}};  // requests alternate between them
  int concurrency = 1;                              // closed loop: requests in flight at all times
  double rate = 0;        // > 0: open loop, this many requests/s whatever the answers
  bool progress = false;  // a live line on stderr about once a second
  absl::Duration duration = absl::Seconds(5);
  int64_t max_requests = 0;            // 0: until duration
  int64_t warmup_requests = 0;         // answers not counted first (sent on top of max_requests)
  int64_t min_len = 16, max_len = 16;  // query length, uniform
  int64_t kv_len = 0;                  // > 0: cross-attention with this key length (value = key)
  int64_t batch = 1;                   // sequences a request
  // The query's and key's dtype on the wire (FP32, FP16 or BF16); the
  // output comes back in the query's.
  v1::DataType dtype = v1::DATA_TYPE_FP32;
  uint32_t seed = 1;
  std::string token;  // bearer token, when the server wants one
  // Closed loop only: each of the `concurrency` slots sends its requests
  // over one Stream (a message each), not one Attend call each.
  bool stream = false;
};

// Closed loop: keeps `concurrency` Attend calls in flight; open loop (rate
// > 0): starts calls at that rate. One channel, callback API, no thread per
// request; runs until the duration or request count is reached. With
// `stream`: one Stream and one thread per slot, a request in flight on each.
LoadReport RunLoad(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& options);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_GENERATOR_H_
