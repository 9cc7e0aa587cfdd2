// mha_client: the sample CLI for mha_server.
//   mha_client health [--model NAME]   (exit 0 only when SERVING)
//   mha_client models
//   mha_client info NAME
//   mha_client attend --model NAME [--query FILE] [--key FILE] [--value FILE]
//                     [--masks FILE] [--batch B --len L --kv_len S]
//                     [--is_causal] [--need_weights] [--per_head_weights] [--bf16 | --fp16]
//                     [--out FILE]
//   mha_client session --model NAME [--steps 32] [--step_tokens 1] [--kv_len S]
//                      [--fork_at K]
//                      (a cross session over a random memory of S tokens; a fork
//                      after K steps that continues another way, checked too)
//   mha_client load --model NAME[,NAME...] [--concurrency N | --rate R] [--duration 10s |
//                   --requests N] [--len_range 16:128] [--kv_len S] [--bf16 | --fp16] [--json]
//                   [--sweep 1,4,16,64 --sweep_out PREFIX] [--stream]
//                   (--stream: each client's requests over one Stream)
//   mha_client export_session ID FILE | import_session FILE [NEW_ID]
//                   (a session to and from a file, e.g. between two servers)
//   mha_client load --sessions N [--steps K] [--step_tokens T] [--json]
//                   (N sessions stepping at once: unary calls, then one Stream each)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/attend_wire.h"
#include "client/client_common.h"
#include "client/load_command.h"
#include "client/load_generator.h"
#include "client/model_commands.h"
#include "client/session_command.h"
#include "client/session_file.h"
#include "client/session_load.h"
#include "client/tensor_files.h"
#include "engine/cli/command_line.h"
#include "engine/file_read.h"
#include "engine/large_buffer.h"
#include "engine/status_macros.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(bool, tls, false, "connect with TLS");
ABSL_FLAG(std::string, ca, "", "--tls: PEM CA certificates to trust (default: the system's)");
ABSL_FLAG(std::string, tls_cert, "", "--tls: PEM client certificate, for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "--tls: PEM private key of --tls_cert");
ABSL_FLAG(std::string, token_file, "", "file holding a bearer token to send");
ABSL_FLAG(std::string, token, "", "an alias of --token_file (a file, not the token)");
ABSL_FLAG(std::string, model, "",
          "model name (attend: default demo; load: a comma-separated list, requests "
          "alternate; health: that model)");
ABSL_FLAG(int64_t, model_version, 0, "attend: the model version to compute with (0: newest)");
ABSL_FLAG(int64_t, deadline_ms, 10000, "deadline of each call");
ABSL_FLAG(int64_t, retries, 2,
          "session: a step whose answer is lost (DEADLINE_EXCEEDED, UNAVAILABLE) is sent "
          "again, at the same expected_position, up to this many times (the server answers "
          "it again without applying it twice)");
ABSL_FLAG(int64_t, resend_step, -1,
          "session: send this step (from 0) twice, as a client whose answer was lost, and "
          "check that both answers are the same bits");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20,
          "largest message this client sends or receives (the server has its own "
          "--max_message_bytes, which GetModel reports)");
ABSL_FLAG(int64_t, batch, 1, "attend, load: batch size B");
ABSL_FLAG(int64_t, len, 16, "attend, load: query length L (load: the same as --len_range L:L)");
ABSL_FLAG(int64_t, kv_len, 0, "key/value length S (0: self-attention)");
ABSL_FLAG(uint32_t, seed, 1, "random inputs' seed");
ABSL_FLAG(bool, is_causal, false, "attend: query i may not attend key j > i (PyTorch's name)");
ABSL_FLAG(bool, causal, false, "attend: an alias of --is_causal");
ABSL_FLAG(std::string, query, "", "attend: safetensors file with the query (else random)");
ABSL_FLAG(bool, random, false,
          "attend: random inputs, the default without --query (kept so that scripts of the "
          "earlier CLI run; with --query it is an error)");
ABSL_FLAG(std::string, key, "", "attend: safetensors file with the key");
ABSL_FLAG(std::string, value, "", "attend: safetensors file with the value");
ABSL_FLAG(std::string, masks, "",
          "attend: safetensors file with key_padding_mask and/or attn_mask");
ABSL_FLAG(bool, bf16, false,
          "attend, load: send query/key/value as BF16 (the output comes back as BF16)");
ABSL_FLAG(bool, fp16, false,
          "attend, load: send query/key/value as FP16 (the output comes back as FP16)");
ABSL_FLAG(std::string, out, "", "attend: write output (and attn_weights) to this safetensors");
ABSL_FLAG(bool, need_weights, false, "attend: return attention weights");
ABSL_FLAG(bool, per_head_weights, false, "attend: weights per head");
ABSL_FLAG(int64_t, steps, 32, "session: steps to append");
ABSL_FLAG(int64_t, step_tokens, 1, "session: tokens per step");
ABSL_FLAG(bool, quiet, false, "session: no line per step");
ABSL_FLAG(int64_t, fork_at, 0,
          "session: fork after this many steps; the fork appends another random continuation, "
          "checked against one Attend over its own whole sequence (0: no fork)");
ABSL_FLAG(int, sessions, 0,
          "load: this many sessions stepping at once (--steps, --step_tokens), over unary calls "
          "and then over one Stream each, instead of Attend calls");
ABSL_FLAG(int, concurrency, 1, "load: requests in flight");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(5), "load: how long");
ABSL_FLAG(int64_t, requests, 0, "load: stop after this many (0: duration)");
ABSL_FLAG(int64_t, warmup_requests, 0,
          "load: answers not counted before the run's own (a new connection opens its flow "
          "control windows over its first large calls)");
ABSL_FLAG(std::string, len_range, "16:16", "load: query lengths MIN:MAX, uniform (or --len)");
ABSL_FLAG(bool, json, false, "load: print the report as JSON");
ABSL_FLAG(double, rate, 0, "load: open loop at this many requests/s (0: closed loop)");
ABSL_FLAG(std::string, sweep, "", "load: run each concurrency of this list, e.g. 1,4,16,64");
ABSL_FLAG(bool, stream, false,
          "load: each of --concurrency clients sends its Attend requests over one Stream "
          "(closed loop), not as one call each");
ABSL_FLAG(std::string, sweep_out, "sweep", "load --sweep: writes PREFIX.csv and PREFIX.svg");

namespace mha::client {
namespace {

// The bearer token from --token, read once in main.
std::string& Token() {
  static std::string* token = new std::string;
  return *token;
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  AddToken(Token(), *context);
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms)));
  return context;
}

// The names of the flags on the command line (Abseil of this version keeps
// that private).
std::set<std::string>& GivenFlags() {
  static auto* given = new std::set<std::string>;
  return *given;
}

// The groups of --help, by command.
std::vector<FlagGroup> FlagGroups() {
  return {
      {"Connection (every command)",
       {"target", "tls", "ca", "tls_cert", "tls_key", "token_file", "token", "deadline_ms",
        "max_message_bytes", "model", "model_version"}},
      {"attend: one Attend call",
       {"batch", "len", "kv_len", "seed", "query", "random", "key", "value", "masks", "is_causal",
        "causal", "need_weights", "per_head_weights", "bf16", "fp16", "out"}},
      {"session: a session stepped and checked against one Attend",
       {"steps", "step_tokens", "quiet", "fork_at", "retries", "resend_step"}},
      {"load: a load generator (Attend calls or sessions)",
       {"concurrency", "duration", "requests", "warmup_requests", "len_range", "rate", "stream",
        "sessions", "json", "sweep", "sweep_out"}},
  };
}

// The dtype of the query, key and value on the wire (--bf16, --fp16).
v1::DataType WireDtype() {
  if (absl::GetFlag(FLAGS_bf16)) return v1::DATA_TYPE_BF16;
  return absl::GetFlag(FLAGS_fp16) ? v1::DATA_TYPE_FP16 : v1::DATA_TYPE_FP32;
}

// The tensor names an input file may hold.
const std::vector<std::string> kInputNames = {"query", "key", "value", "key_padding_mask",
                                              "attn_mask"};

// Fills the request's tensors from files, or randomly.
absl::Status FillInputs(const v1::ModelInfo& info, v1::AttendRequest& request) {
  const int64_t client_limit = absl::GetFlag(FLAGS_max_message_bytes);
  if (absl::GetFlag(FLAGS_query).empty()) {
    std::mt19937 gen(absl::GetFlag(FLAGS_seed));
    const int64_t b = absl::GetFlag(FLAGS_batch), l = absl::GetFlag(FLAGS_len);
    const int64_t s = absl::GetFlag(FLAGS_kv_len);
    RETURN_IF_ERROR(CheckShapeFlags(b, l, s));
    const double element_bytes = WireDtype() == v1::DATA_TYPE_FP32 ? 4.0 : 2.0;
    const double bytes = element_bytes * b *
                         (double(l) * info.embed_dim() + double(s) * (info.kdim() + info.vdim()));
    RETURN_IF_ERROR(CheckRequestBytes(bytes, client_limit, info.max_message_bytes(),
                                      "send fewer tokens (--batch, --len, --kv_len)"));
    *request.mutable_query() = RandomTensor({b, l, info.embed_dim()}, gen);
    if (s > 0) {
      *request.mutable_key() = RandomTensor({b, s, info.kdim()}, gen);
      *request.mutable_value() = RandomTensor({b, s, info.vdim()}, gen);
    }
  } else {
    for (const char* random_only : {"batch", "len", "kv_len", "seed", "random"}) {
      if (GivenFlags().count(random_only) > 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", random_only, " is for random inputs; with --query the files give the inputs"));
      }
    }
    // The files' bytes bound what is sent (each file once; --bf16 halves f32).
    double bytes = 0;
    std::set<std::string> files;
    for (const std::string& path :
         {absl::GetFlag(FLAGS_query), absl::GetFlag(FLAGS_key), absl::GetFlag(FLAGS_value)}) {
      if (path.empty()) continue;
      RETURN_IF_ERROR(CheckTensorNames(path, kInputNames, /*any_single=*/true));
      std::error_code error;
      const std::uintmax_t size = std::filesystem::file_size(path, error);
      if (!error && files.insert(path).second) bytes += static_cast<double>(size);
    }
    if (WireDtype() != v1::DATA_TYPE_FP32) bytes /= 2;
    RETURN_IF_ERROR(
        CheckRequestBytes(bytes, client_limit, info.max_message_bytes(), "send fewer tokens"));
    absl::StatusOr<v1::Tensor> t = ReadWireTensor(absl::GetFlag(FLAGS_query), "query");
    if (!t.ok()) return t.status();
    *request.mutable_query() = *t;
    for (const char* name : {"key", "value"}) {
      const std::string path = absl::GetFlag(std::string(name) == "key" ? FLAGS_key : FLAGS_value);
      if (path.empty()) continue;  // touching the field would send an empty tensor
      absl::StatusOr<v1::Tensor> kv = ReadWireTensor(path, name);
      if (!kv.ok()) return kv.status();
      *(std::string(name) == "key" ? request.mutable_key() : request.mutable_value()) = *kv;
    }
  }
  const std::string masks = absl::GetFlag(FLAGS_masks);
  if (!masks.empty()) {
    RETURN_IF_ERROR(CheckTensorNames(masks, {"key_padding_mask", "attn_mask"}, false));
  }
  for (const char* name : {"key_padding_mask", "attn_mask"}) {
    if (masks.empty()) break;
    absl::StatusOr<bool> has = HasTensor(masks, name);
    if (!has.ok()) return has.status();
    if (!*has) continue;  // touching the field would send an empty mask
    absl::StatusOr<v1::Tensor> m = ReadWireTensor(masks, name);
    if (!m.ok()) return m.status();
    *(std::string(name) == "attn_mask" ? request.mutable_attn_mask()
                                       : request.mutable_key_padding_mask()) = *m;
  }
  if (const v1::DataType dtype = WireDtype(); dtype != v1::DATA_TYPE_FP32) {
    *request.mutable_query() = ToWireDtype(request.query(), dtype);
    if (request.has_key()) *request.mutable_key() = ToWireDtype(request.key(), dtype);
    if (request.has_value()) *request.mutable_value() = ToWireDtype(request.value(), dtype);
  }
  return absl::OkStatus();
}

int Attend(v1::AttentionService::Stub& stub, const std::shared_ptr<grpc::Channel>& channel) {
  v1::GetModelRequest get;
  get.set_name(absl::GetFlag(FLAGS_model));
  v1::ModelInfo info;
  grpc::Status status = stub.GetModel(Context().get(), get, &info);
  if (!status.ok()) return ReportError(status);
  v1::AttendRequest request;
  request.set_model(info.name());
  request.set_model_version(absl::GetFlag(FLAGS_model_version));
  if (const absl::Status filled = FillInputs(info, request); !filled.ok()) {
    std::fprintf(stderr, "%s\n", filled.ToString().c_str());
    return 2;
  }
  request.set_is_causal(absl::GetFlag(FLAGS_is_causal) || absl::GetFlag(FLAGS_causal));
  request.set_need_weights(absl::GetFlag(FLAGS_need_weights));
  request.set_per_head_weights(absl::GetFlag(FLAGS_per_head_weights));
  // The request's bytes written once before the clock starts; the response
  // read around its tensors' bytes (attend_wire.h).
  // The one call polled on this thread, as a blocking client's: not over
  // gRPC's callback threads, whose leaving at exit can strand the TCP write
  // backup poller a large request starts, and grpc_shutdown then waits out
  // its 10 s (issue 85).
  const grpc::ByteBuffer request_bytes = AttendRequestBytes(request);
  grpc::GenericStub generic(channel);
  std::unique_ptr<grpc::ClientContext> context = Context();
  grpc::CompletionQueue cq;
  ReceivedAttendResponse received;
  const absl::Time sent = absl::Now();
  const absl::Status called =
      CallAttendPolling(generic, context.get(), request_bytes, cq, received);
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - sent);
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  if (!called.ok()) {
    return ReportError(
        grpc::Status(static_cast<grpc::StatusCode>(called.code()), std::string(called.message())));
  }
  const v1::AttendResponse response = received.Whole();
  const std::vector<float> out = TensorValues(response.output());
  double checksum = 0;
  for (float v : out) checksum += v;
  std::printf("model %s version %lld: query %s -> output %s checksum %.6f first",
              response.model().c_str(), static_cast<long long>(response.model_version()),
              ShapeText(request.query()).c_str(), ShapeText(response.output()).c_str(), checksum);
  for (size_t i = 0; i < std::min<size_t>(4, out.size()); ++i) std::printf(" %+.5f", out[i]);
  std::printf("\n");
  if (response.has_attn_weights()) {
    std::printf("attn_weights %s\n", ShapeText(response.attn_weights()).c_str());
  }
  const auto& trailers = context->GetServerTrailingMetadata();
  for (const auto& [trailer, label] :
       {std::pair{"mha-server-time-us", "server"}, std::pair{"mha-compute-time-us", "compute"}}) {
    const auto us = trailers.find(trailer);
    if (us == trailers.end()) continue;
    std::printf("%s %.3f ms, ", label,
                std::atof(std::string(us->second.data(), us->second.size()).c_str()) / 1e3);
  }
  std::printf("round trip %.3f ms\n", ms);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (!out_path.empty()) {
    std::map<std::string, const v1::Tensor*> results = {{"output", &response.output()}};
    if (response.has_attn_weights()) results["attn_weights"] = &response.attn_weights();
    if (const absl::Status written = WriteWireTensors(out_path, results); !written.ok()) {
      std::fprintf(stderr, "%s\n", written.ToString().c_str());
      return 1;
    }
    std::printf("wrote %s\n", out_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace mha::client

int main(int argc, char** argv) {
  // As the server's: large calls reuse their pages (engine/large_buffer.h),
  // and Abseil does not check gRPC's lock order at every acquisition.
  mha::SetHeapThresholds();
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "mha_client {health [--model NAME] | models | info NAME | attend | session | load | "
      "load_model NAME | unload_model NAME | export_session ID FILE | import_session FILE "
      "[NEW_ID]} [--target "
      "host:port] [--tls [--ca FILE] [--tls_cert FILE --tls_key FILE]] [--token_file FILE]");
  const mha::CommandLine line = mha::ParseCommandLineOrExit(argc, argv, absl::ProgramUsageMessage(),
                                                            mha::client::FlagGroups(), "client/");
  mha::client::GivenFlags() = line.given;
  const std::vector<char*>& args = line.args;
  if (args.size() < 2) {
    std::fprintf(stderr, "usage: %s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  if (absl::GetFlag(FLAGS_bf16) && absl::GetFlag(FLAGS_fp16)) {
    std::fprintf(stderr, "--bf16 and --fp16: one wire dtype at a time\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_message_bytes) < 1) {
    std::fprintf(stderr, "--max_message_bytes: at least 1, got %lld\n",
                 static_cast<long long>(absl::GetFlag(FLAGS_max_message_bytes)));
    return 2;
  }
  mha::client::ConnectionOptions connection{
      .target = absl::GetFlag(FLAGS_target),
      .tls = absl::GetFlag(FLAGS_tls),
      .ca_file = absl::GetFlag(FLAGS_ca),
      .cert_file = absl::GetFlag(FLAGS_tls_cert),
      .key_file = absl::GetFlag(FLAGS_tls_key),
      .max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes)};
  const std::string token_file = absl::GetFlag(FLAGS_token_file).empty()
                                     ? absl::GetFlag(FLAGS_token)
                                     : absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = mha::ReadWholeFile(token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "%s\n", token.status().ToString().c_str());
      return 2;
    }
    mha::client::Token() = std::string(absl::StripAsciiWhitespace(*token));
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> made = mha::client::MakeChannel(connection);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    return 2;
  }
  const std::shared_ptr<grpc::Channel> channel = *made;
  auto stub = mha::v1::AttentionService::NewStub(channel);
  const bool named = command == "info" || command == "load_model" || command == "unload_model";
  if (command == "export_session" || command == "import_session") {
    const bool out = command == "export_session";
    if (args.size() < (out ? 4u : 3u) || args.size() > 4) {
      std::fprintf(stderr,
                   "usage: mha_client export_session ID FILE | import_session FILE "
                   "[NEW_ID]\n");
      return 2;
    }
    return out ? mha::client::ExportSessionToFile(*stub, args[2], args[3], mha::client::Context())
               : mha::client::ImportSessionFromFile(*stub, args[2], args.size() > 3 ? args[3] : "",
                                                    mha::client::Context());
  }
  const size_t expected_args = named ? 3 : 2;
  if (named && args.size() < 3) {
    std::fprintf(stderr, "%s: expected a model name, e.g. mha_client %s demo\n", command.c_str(),
                 command.c_str());
    return 2;
  }
  if (args.size() > expected_args) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags are written --name=value)\n",
                 command.c_str(), args[expected_args]);
    return 2;
  }
  const mha::client::ContextFactory context = [] { return mha::client::Context(); };
  if (command == "health") {
    return mha::client::Health(channel, absl::GetFlag(FLAGS_model), context);
  }
  if (absl::GetFlag(FLAGS_model).empty()) absl::SetFlag(&FLAGS_model, "demo");
  if (command == "models") return mha::client::Models(*stub, context);
  if (command == "info") return mha::client::Info(*stub, args[2], context);
  if (command == "attend") return mha::client::Attend(*stub, channel);
  if (command == "load") {
    mha::client::LoadCommand load;
    load.models = absl::GetFlag(FLAGS_model);
    load.sessions = absl::GetFlag(FLAGS_sessions);
    load.steps = absl::GetFlag(FLAGS_steps);
    load.step_tokens = absl::GetFlag(FLAGS_step_tokens);
    load.concurrency = absl::GetFlag(FLAGS_concurrency);
    load.rate = absl::GetFlag(FLAGS_rate);
    load.stream = absl::GetFlag(FLAGS_stream);
    load.duration = absl::GetFlag(FLAGS_duration);
    load.requests = absl::GetFlag(FLAGS_requests);
    load.warmup_requests = absl::GetFlag(FLAGS_warmup_requests);
    load.batch = absl::GetFlag(FLAGS_batch);
    load.len = absl::GetFlag(FLAGS_len);
    load.len_given = mha::client::GivenFlags().count("len") > 0;
    load.len_range = absl::GetFlag(FLAGS_len_range);
    load.len_range_given = mha::client::GivenFlags().count("len_range") > 0;
    load.kv_len = absl::GetFlag(FLAGS_kv_len);
    load.seed = absl::GetFlag(FLAGS_seed);
    load.dtype = mha::client::WireDtype();
    load.token = mha::client::Token();
    load.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
    load.json = absl::GetFlag(FLAGS_json);
    load.sweep = absl::GetFlag(FLAGS_sweep);
    load.sweep_out = absl::GetFlag(FLAGS_sweep_out);
    return mha::client::RunLoadCommand(channel, load, context);
  }
  if (command == "session") {
    return mha::client::RunSession(
        *stub, {.model = absl::GetFlag(FLAGS_model),
                .steps = std::max<int64_t>(1, absl::GetFlag(FLAGS_steps)),
                .step_tokens = std::max<int64_t>(1, absl::GetFlag(FLAGS_step_tokens)),
                .memory_len = absl::GetFlag(FLAGS_kv_len),
                .fork_at = std::max<int64_t>(0, absl::GetFlag(FLAGS_fork_at)),
                .seed = absl::GetFlag(FLAGS_seed),
                .quiet = absl::GetFlag(FLAGS_quiet),
                .retries = std::max<int64_t>(0, absl::GetFlag(FLAGS_retries)),
                .resend_step = absl::GetFlag(FLAGS_resend_step),
                .context = context});
  }
  if (command == "load_model") return mha::client::ControlModel(*stub, true, args[2], context);
  if (command == "unload_model") return mha::client::ControlModel(*stub, false, args[2], context);
  std::fprintf(stderr, "unknown command '%s'\nusage: %s\n", command.c_str(),
               absl::ProgramUsageMessage().data());
  return 2;
}
