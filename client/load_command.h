// mha_client load: Attend requests of random shapes at a concurrency or a
// rate (or a sweep of concurrencies, or sessions stepping), reported as
// text or JSON. The command line's values arrive in a LoadCommand, so that
// this file knows no flags.
#ifndef MHA_CLIENT_LOAD_COMMAND_H_
#define MHA_CLIENT_LOAD_COMMAND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "client/model_commands.h"
#include "grpcpp/grpcpp.h"

namespace mha::client {

// What `load` was asked for (the flags of the same names). Plain value.
struct LoadCommand {
  std::string models;  // NAME[,NAME...]
  int sessions = 0;    // > 0: sessions stepping instead of Attend requests
  int64_t steps = 32, step_tokens = 1;
  int concurrency = 1;
  double rate = 0;
  bool stream = false;
  absl::Duration duration = absl::Seconds(5);
  int64_t requests = 0;
  int64_t warmup_requests = 0;
  int64_t batch = 1;
  int64_t len = 16;
  bool len_given = false;  // --len on the command line
  std::string len_range = "16:16";
  bool len_range_given = false;
  int64_t kv_len = 0;
  v1::DataType dtype = v1::DATA_TYPE_FP32;  // --fp16, --bf16
  uint32_t seed = 1;
  std::string token;
  int64_t max_message_bytes = 0;
  bool json = false;
  std::string sweep, sweep_out = "sweep";
};

// Runs `load`; returns the exit code (2: a flag is wrong, 1: calls failed).
int RunLoadCommand(const std::shared_ptr<grpc::Channel>& channel, const LoadCommand& command,
                   const ContextFactory& context);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_COMMAND_H_
