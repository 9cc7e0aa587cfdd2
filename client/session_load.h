// mha_client load --sessions N --steps K: N sessions stepping at once, over
// unary calls and then over one Stream each.
#ifndef MHA_CLIENT_SESSION_LOAD_H_
#define MHA_CLIENT_SESSION_LOAD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "client/client_common.h"
#include "grpcpp/grpcpp.h"

namespace mha::client {

struct SessionLoadOptions {
  LoadTarget target;  // its kdim is not used: sessions here are self-attention
  int sessions = 8;
  int64_t steps = 32;
  int64_t step_tokens = 1;
  uint32_t seed = 1;
  std::string token;
};

struct SessionLoadReport {
  std::string mode;  // "unary" or "stream"
  int64_t steps = 0, tokens = 0;
  std::map<std::string, int64_t> errors;  // by status code name
  double seconds = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;  // per step

  std::string Text() const;
  std::string Json() const;
};

// One thread per session: opens it, appends `steps` steps of random tokens
// (each waiting for the previous answer, as a decoder does), closes it.
SessionLoadReport RunSessionLoad(const std::shared_ptr<grpc::Channel>& channel,
                                 const SessionLoadOptions& options, bool stream);

}  // namespace mha::client

#endif  // MHA_CLIENT_SESSION_LOAD_H_
