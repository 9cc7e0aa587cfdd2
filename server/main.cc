// mha_server: serves the models of a repository over gRPC
// (mha.v1.AttentionService, KServe v2 inference.GRPCInferenceService,
// grpc.health.v1, reflection) with Prometheus metrics on /metrics. This
// file reads the flags into ServerOptions and waits for SIGTERM; the
// server itself is server/server.h.
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/cli/command_line.h"
#include "engine/large_buffer.h"
#include "server/observability/logger.h"
#include "server/server.h"

#ifndef MHA_DEFAULT_MODEL_REPOSITORY
#define MHA_DEFAULT_MODEL_REPOSITORY "models"
#endif

ABSL_FLAG(std::string, model_repository, MHA_DEFAULT_MODEL_REPOSITORY,
          "folder of model folders (config.pbtxt + weights.safetensors)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one");
ABSL_FLAG(std::string, model_name, "",
          "When --model_repository is itself one model's folder (config.pbtxt at its top, as "
          "KServe's storage initializer leaves one model in /mnt/models): the name it is served "
          "under; empty: the folder's name");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port; 0 picks a free one");
ABSL_FLAG(int, http_port, 8000,
          "KServe v2 over HTTP/REST (Triton's HTTP API, binary tensor extension); 0 turns it off");
ABSL_FLAG(std::string, http_cors_origin, "",
          "Access-Control-Allow-Origin of HTTP answers (e.g. https://app.example or *); empty: "
          "no CORS");
ABSL_FLAG(int, http_idle_timeout_s, 60,
          "HTTP connections silent this long (idle keep-alive, or slow to send) are closed");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "largest request or response message");
ABSL_FLAG(int, workers, 2,
          "engine worker threads of the server, shared by every model and version");
ABSL_FLAG(int, intra_op_threads, 0,
          "threads per engine call; 0: all cores for a call that starts while no other runs, "
          "cores / workers for one that starts beside another");
ABSL_FLAG(int, shutdown_grace_s, 30, "seconds to finish queued requests on SIGTERM");
ABSL_FLAG(bool, disable_batching, false, "one request per engine call, whatever the configs say");
ABSL_FLAG(int64_t, max_request_tokens, int64_t{1} << 20, "query + key tokens per request");
ABSL_FLAG(int64_t, memory_limit_bytes, 0,
          "working memory of requests in flight plus the engines' reserve; 0: 75% of the "
          "cgroup's memory limit, of what RLIMIT_AS leaves, or of physical memory");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve gRPC over TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(std::string, model_control_mode, "none",
          "none: the repository is read once, at start; poll: re-read every "
          "--repository_poll_s (new, changed and removed models and versions); explicit: only "
          "the LoadModel / UnloadModel RPCs, and --load_model at start");
ABSL_FLAG(int, repository_poll_s, 15, "seconds between reads of the repository in poll mode");
ABSL_FLAG(std::string, upload_dir, "",
          "where a model sent over the API (Triton's load_model with config and files; explicit "
          "mode) is written while it loads, in a private folder removed once loaded; empty: "
          "$TMPDIR or /tmp");
ABSL_FLAG(std::vector<std::string>, load_model, {},
          "explicit mode: a model to load at start (repeatable, or comma-separated)");
ABSL_FLAG(int64_t, session_cache_bytes, 0,
          "bytes of key/value cache blocks all sessions share, reserved in the memory limit; "
          "when full, idle sessions are evicted least recently used first. 0: a quarter of "
          "what the memory limit leaves beyond the engines' reserve, at most 512 MiB");
ABSL_FLAG(int64_t, max_sessions, 1024, "sessions open at once");
ABSL_FLAG(std::string, session_spill_dir, "",
          "keep sessions across restarts: on SIGTERM, after the grace period's steps, write every "
          "session to this folder; at start, bring back those whose model version still serves "
          "(empty: sessions end with the process)");
ABSL_FLAG(int, session_idle_timeout_s, 60,
          "seconds after its last use a session expires (OpenSession may ask for another)");
ABSL_FLAG(int64_t, session_max_tokens, 8192,
          "tokens a self-attention session may hold (the default and the cap of OpenSession's "
          "max_tokens)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token the attention and model RPCs require (health stays open)");
ABSL_FLAG(std::string, log_format, "default",
          "default (I1202 14:05:01.123456 <thread>] message), ISO8601, or json (one object a "
          "line); times in UTC. LogSettings / POST /v2/logging change the log_ settings later");
ABSL_FLAG(std::string, log_file, "", "write the log to this file (appended); empty: stderr");
ABSL_FLAG(bool, log_info, true, "write info lines");
ABSL_FLAG(bool, log_warning, true, "write warning lines");
ABSL_FLAG(bool, log_error, true, "write error lines");
ABSL_FLAG(uint32_t, log_verbose_level, 0, "write verbose lines up to this level (0: none)");

namespace mha::server {
namespace {

// Every --load_model given: Abseil keeps only the last occurrence of a flag,
// so they are collected from the command line first.
std::vector<std::string> LoadModelFlags(int argc, char** argv) {
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    std::string value;
    const std::string arg = argv[i];
    if (arg.rfind("--load_model=", 0) == 0) {
      value = arg.substr(strlen("--load_model="));
    } else if (arg == "--load_model" && i + 1 < argc) {
      value = argv[++i];
    } else {
      continue;
    }
    for (absl::string_view name : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      names.emplace_back(name);
    }
  }
  return names;
}

// The groups of --help.
std::vector<FlagGroup> FlagGroups() {
  return {
      {"Models",
       {"model_repository", "model_name", "model_control_mode", "repository_poll_s", "load_model",
        "upload_dir"}},
      {"Ports and messages",
       {"host", "port", "metrics_port", "http_port", "http_cors_origin", "http_idle_timeout_s",
        "max_message_bytes"}},
      {"Security", {"tls_cert", "tls_key", "tls_client_ca", "auth_token_file"}},
      {"Compute and memory",
       {"workers", "intra_op_threads", "disable_batching", "max_request_tokens",
        "memory_limit_bytes", "shutdown_grace_s"}},
      {"Sessions",
       {"session_cache_bytes", "max_sessions", "session_max_tokens", "session_idle_timeout_s",
        "session_spill_dir"}},
      {"Logging",
       {"log_format", "log_file", "log_info", "log_warning", "log_error", "log_verbose_level"}},
  };
}

// The logger as the log_ flags say (server/observability/logger.h).
absl::Status ConfigureLoggingFromFlags() {
  absl::StatusOr<LogFormat> format = ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  if (!format.ok()) return format.status();
  LogSettings settings;
  settings.format = *format;
  settings.file = absl::GetFlag(FLAGS_log_file);
  settings.info = absl::GetFlag(FLAGS_log_info);
  settings.warning = absl::GetFlag(FLAGS_log_warning);
  settings.error = absl::GetFlag(FLAGS_log_error);
  settings.verbose_level = absl::GetFlag(FLAGS_log_verbose_level);
  return ConfigureLogging(settings);
}

ServerOptions OptionsFromFlags(std::vector<std::string> load_models) {
  ServerOptions o;
  o.model_repository = absl::GetFlag(FLAGS_model_repository);
  o.model_name = absl::GetFlag(FLAGS_model_name);
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.http_port = absl::GetFlag(FLAGS_http_port);
  o.http_cors_origin = absl::GetFlag(FLAGS_http_cors_origin);
  o.http_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_http_idle_timeout_s));
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.workers = absl::GetFlag(FLAGS_workers);
  o.intra_op_threads = absl::GetFlag(FLAGS_intra_op_threads);
  o.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  o.disable_batching = absl::GetFlag(FLAGS_disable_batching);
  o.max_request_tokens = absl::GetFlag(FLAGS_max_request_tokens);
  o.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_bytes);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.model_control_mode = absl::GetFlag(FLAGS_model_control_mode);
  o.repository_poll = absl::Seconds(absl::GetFlag(FLAGS_repository_poll_s));
  o.upload_dir = absl::GetFlag(FLAGS_upload_dir);
  o.load_models = std::move(load_models);
  o.session_cache_bytes = absl::GetFlag(FLAGS_session_cache_bytes);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.session_spill_dir = absl::GetFlag(FLAGS_session_spill_dir);
  o.session_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_session_idle_timeout_s));
  o.session_max_tokens = absl::GetFlag(FLAGS_session_max_tokens);
  o.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  return o;
}

// Open files up to the hard limit: each HTTP keep-alive connection is one
// (the soft limit is often 1,024; a thousand idle clients must not refuse
// the next one).
void RaiseOpenFileLimit() {
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }
}

int Serve(ServerOptions options) {
  RaiseOpenFileLimit();
  // SIGTERM / SIGINT are taken by sigwait below, in plain view, not by a
  // handler: block them before any thread starts so every thread inherits.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(std::move(options));
  if (!server.ok()) {
    LogError(server.status().ToString());
    return 1;
  }
  const std::string ready = (*server)->ReadyLine();
  LogInfo(ready);
  std::printf("%s\n", ready.c_str());  // on stdout too, a contract for scripts
  std::fflush(stdout);

  int received = 0;
  sigwait(&signals, &received);
  (*server)->StartDraining();
  // Said once draining has begun (tests wait for this line).
  LogInfo(absl::StrCat("signal ", received, ", draining"));
  (*server)->Drain();
  return 0;
}

}  // namespace
}  // namespace mha::server

int main(int argc, char** argv) {
  mha::SetHeapThresholds();  // engine/large_buffer.h
  // Debian's Abseil checks every absl::Mutex acquisition (gRPC takes several
  // per call) against a lock-order graph: 1-2 % of the server's CPU under
  // load. Our own locks are std::mutex, checked by the ThreadSanitizer build.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage("mha_server [--model_repository DIR] [--port N] [--metrics_port N]");
  const std::vector<std::string> load_models = mha::server::LoadModelFlags(argc, argv);
  const mha::CommandLine line = mha::ParseCommandLineOrExit(argc, argv, absl::ProgramUsageMessage(),
                                                            mha::server::FlagGroups(), "server/");
  if (line.args.size() > 1) {
    std::fprintf(stderr,
                 "INVALID_ARGUMENT: unexpected argument '%s' (flags are --name=value; "
                 "see --help)\n",
                 line.args[1]);
    return 2;
  }
  if (const absl::Status logging = mha::server::ConfigureLoggingFromFlags(); !logging.ok()) {
    std::fprintf(stderr, "%s\n", logging.ToString().c_str());
    return 2;
  }
  return mha::server::Serve(mha::server::OptionsFromFlags(load_models));
}
