// mha_client session: opens a session, appends a random sequence step by
// step (printing each step's time), checks the outputs against one Attend
// over the whole sequence, and closes it. With --fork_at K, the session is
// forked after K steps and the fork appends another random continuation,
// checked against one Attend over its own whole sequence. A step whose
// answer is lost (DEADLINE_EXCEEDED, UNAVAILABLE) is sent again, at the
// same expected_position, up to --retries times: the server answers it
// again without applying it twice. --resend_step K sends step K twice, as
// a client whose first answer was lost would, and checks that both answers
// are the same bits.
#ifndef MHA_CLIENT_SESSION_COMMAND_H_
#define MHA_CLIENT_SESSION_COMMAND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::client {

struct SessionCommandOptions {
  std::string model = "demo";
  int64_t steps = 32;
  int64_t step_tokens = 1;
  int64_t memory_len = 0;  // > 0: a cross session over a random memory
  int64_t fork_at = 0;     // > 0: fork after this many steps
  uint32_t seed = 1;
  bool quiet = false;        // no line per step
  int64_t retries = 2;       // a step sent again when its answer is lost
  int64_t resend_step = -1;  // >= 0: this step sent twice, both answers compared
  // A new context per call (deadline, token).
  std::function<std::unique_ptr<grpc::ClientContext>()> context;
};

// The largest difference from the full Attend that still passes: fp32
// summed in another order over up to a few thousand keys.
inline constexpr float kSessionCheckTolerance = 1e-4f;

// Exit code: 0 when every step was answered and matches; 1 otherwise.
int RunSession(v1::AttentionService::Stub& stub, const SessionCommandOptions& options);

}  // namespace mha::client

#endif  // MHA_CLIENT_SESSION_COMMAND_H_
