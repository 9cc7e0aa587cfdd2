// mha_server: serves the models of a repository over gRPC
// (mha.v1.AttentionService, KServe v2 inference.GRPCInferenceService,
// grpc.health.v1, reflection) with Prometheus
// metrics on /metrics.
#include <malloc.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"
#include "engine/status_macros.h"
#include "server/attention_service.h"
#include "server/auth.h"
#include "server/health_reporter.h"
#include "server/kserve_service.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/model_control.h"
#include "server/model_repository.h"
#include "server/reflection_v1.h"
#include "server/scheduling/worker_pool.h"
#include "server/session_manager.h"

#ifndef MHA_DEFAULT_MODEL_REPOSITORY
#define MHA_DEFAULT_MODEL_REPOSITORY "models"
#endif

ABSL_FLAG(std::string, model_repository, MHA_DEFAULT_MODEL_REPOSITORY,
          "folder of model folders (config.pbtxt + weights.safetensors)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port; 0 picks a free one");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "largest request or response message");
ABSL_FLAG(int, workers, 1,
          "engine worker threads of the server, shared by every model and version");
ABSL_FLAG(int, intra_op_threads, 0, "threads per engine call; 0: cores / workers");
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
ABSL_FLAG(std::vector<std::string>, load_model, {},
          "explicit mode: a model to load at start (repeatable, or comma-separated)");
ABSL_FLAG(int64_t, session_cache_bytes, 0,
          "bytes of key/value cache blocks all sessions share, reserved in the memory limit; "
          "when full, idle sessions are evicted least recently used first. 0: a quarter of "
          "what the memory limit leaves beyond the engines' reserve, at most 512 MiB");
ABSL_FLAG(int64_t, max_sessions, 1024, "sessions open at once");
ABSL_FLAG(int, session_idle_timeout_s, 60,
          "seconds after its last use a session expires (OpenSession may ask for another)");
ABSL_FLAG(int64_t, session_max_tokens, 8192,
          "tokens a self-attention session may hold (the default and the cap of OpenSession's "
          "max_tokens)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token the attention and model RPCs require (health stays open)");

namespace mha::server {
namespace {

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                              : absl::StrCat(host, ":", port);
}

std::string ModelSummary(const ModelRepository& models) {
  std::vector<std::string> parts;
  for (const v1::ModelInfo& info : models.Infos()) {
    parts.push_back(
        absl::StrCat(info.name(), info.state() == v1::ModelInfo::STATE_READY ? "" : "(failed)"));
  }
  return absl::StrJoin(parts, ",");
}

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

// What the process holds before any request: its resident memory with the
// models loaded (their packed weights and warm-up primitives), plus what
// the primitive caches may still add (per model version, at least the
// allowance of one busy model: oneDNN shares the primitives of equal shapes
// across models), plus per engine worker the workspace it keeps.
int64_t EngineReserve(const ModelRepository& models, const WorkerPool& pool) {
  constexpr int64_t kPrimitivesAtLeast = int64_t{32} << 20;
  int64_t versions = 0;
  for (const std::string& name : models.Ready()) {
    versions += static_cast<int64_t>(models.ReadyVersions(name).size());
  }
  return ResidentBytes() +
         std::max(kPrimitivesAtLeast, versions * MhaEngine::kPrimitiveCacheBytes) +
         pool.workers() * static_cast<int64_t>(MhaEngine::kWorkspaceKeepBytes);
}

// --session_cache_bytes, 0 resolved against what requests could otherwise
// have: `available`, the memory limit beyond the engines' reserve.
int64_t SessionCacheBytes(int64_t flag, int64_t available) {
  constexpr int64_t kDefaultCap = int64_t{512} << 20;
  if (flag > 0) return flag;
  return std::clamp<int64_t>(available / 4, 0, kDefaultCap);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Insecure, TLS, or mutual TLS, from the flags.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials() {
  const std::string cert = absl::GetFlag(FLAGS_tls_cert), key = absl::GetFlag(FLAGS_tls_key);
  const std::string client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (cert.empty() && key.empty() && client_ca.empty()) return grpc::InsecureServerCredentials();
  if (cert.empty() || key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(cert));
  ASSIGN_OR_RETURN(pair.private_key, ReadFile(key));
  options.pem_key_cert_pairs.push_back(pair);
  if (!client_ca.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadFile(client_ca));
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

int Serve(const std::vector<std::string>& load_models) {
  // SIGTERM / SIGINT are taken by sigwait below, in plain view, not by a
  // handler: block them before any thread starts so every thread inherits.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  Metrics metrics;
  const MemoryLimit memory_limit = ResolveMemoryLimit(absl::GetFlag(FLAGS_memory_limit_bytes));
  MemoryBudget memory(memory_limit.bytes, &metrics.memory_reserved());
  metrics.memory_limit().Set(static_cast<double>(memory_limit.bytes));
  // One pool of engine workers serves every model: threads follow the
  // cores and --workers, never the number of models.
  WorkerPool pool(WorkerPoolOptions{.workers = absl::GetFlag(FLAGS_workers),
                                    .compute_threads = absl::GetFlag(FLAGS_intra_op_threads)});
  RepositoryOptions repo_options{.pool = &pool,
                                 .force_batching_off = absl::GetFlag(FLAGS_disable_batching),
                                 .memory = &memory};
  const absl::StatusOr<ModelControlMode> mode =
      ParseModelControlMode(absl::GetFlag(FLAGS_model_control_mode));
  if (!mode.ok()) {
    std::fprintf(stderr, "mha_server: %s\n", std::string(mode.status().message()).c_str());
    return 1;
  }
  auto models = std::make_unique<ModelRepository>(absl::GetFlag(FLAGS_model_repository),
                                                  repo_options, metrics);
  if (absl::Status loaded = LoadAtStart(*models, *mode, load_models); !loaded.ok()) {
    std::fprintf(stderr, "mha_server: %s\n", loaded.ToString().c_str());
    return 1;
  }
  const int64_t engine_reserve = EngineReserve(*models, pool);
  const int64_t session_cache_bytes = SessionCacheBytes(
      absl::GetFlag(FLAGS_session_cache_bytes), memory.limit() - engine_reserve);
  memory.SetReserve(engine_reserve + session_cache_bytes);
  if (memory.capacity() <= 0) {
    std::fprintf(stderr, "mha_server: --memory_limit_bytes %s leaves nothing for requests "
                 "beyond the engines' reserve and the session cache, %s bytes\n",
                 WithCommas(memory.limit()).c_str(), WithCommas(memory.reserve()).c_str());
    return 1;
  }

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials();
  absl::StatusOr<BearerAuth> auth = BearerAuth::FromFile(absl::GetFlag(FLAGS_auth_token_file));
  for (const absl::Status& s : {credentials.status(), auth.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "mha_server: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  const std::string host = absl::GetFlag(FLAGS_host);
  prometheus::Exposer exposer(HostPort(host, absl::GetFlag(FLAGS_metrics_port)));
  exposer.RegisterCollectable(metrics.registry());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  HealthReporter health(*models);
  ModelControl control(*models, *mode,
                       absl::Seconds(std::max(1, absl::GetFlag(FLAGS_repository_poll_s))),
                       [&health] { health.Update(); });
  AttendDispatcher dispatcher(
      *models, metrics,
      RequestLimits{.max_tokens = absl::GetFlag(FLAGS_max_request_tokens),
                    .max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes)},
      memory, *std::move(auth));
  SessionManager sessions(
      SessionOptions{.cache_bytes = session_cache_bytes,
                     .max_sessions = absl::GetFlag(FLAGS_max_sessions),
                     .idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_session_idle_timeout_s)),
                     .max_tokens = absl::GetFlag(FLAGS_session_max_tokens),
                     .memory = &memory},
      metrics.Sessions());
  AttentionServiceImpl service(dispatcher, control, sessions);
  KserveServiceImpl kserve(dispatcher, control);
  ReflectionV1Service reflection_v1(ServedServiceNames());
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  builder.AddListeningPort(HostPort(host, absl::GetFlag(FLAGS_port)),
                           *credentials, &grpc_port);
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.RegisterService(&service);
  builder.RegisterService(&kserve);
  builder.RegisterService(&reflection_v1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    std::fprintf(stderr, "mha_server: cannot listen on %s\n",
                 HostPort(host, absl::GetFlag(FLAGS_port)).c_str());
    return 1;
  }
  health.Attach(server.get(), /*serving=*/true);
  std::printf("mha_server ready grpc_port=%d metrics_port=%d models=%s memory_limit_bytes=%lld "
              "(%s; engines' reserve and session cache %s)\n",
              grpc_port, exposer.GetListeningPorts().front(), ModelSummary(*models).c_str(),
              static_cast<long long>(memory.limit()), memory_limit.source.c_str(),
              WithCommas(memory.reserve()).c_str());
  std::fflush(stdout);

  int received = 0;
  sigwait(&signals, &received);
  health.StopServing();
  dispatcher.StartDraining();
  sessions.StartDraining();  // no new sessions; steps go on until the grace period ends
  // Said once draining has begun (tests wait for this line).
  std::fprintf(stderr, "mha_server: signal %d, draining\n", received);
  control.Stop();  // queued loads answered UNAVAILABLE, so Shutdown does not wait for them
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
  sessions.Stop();
  models->Stop();
  server->Wait();
  health.Attach(nullptr, false);
  return 0;
}

}  // namespace
}  // namespace mha::server

// glibc's malloc raises its mmap threshold to the largest block freed (up
// to 32 MiB) and its trim threshold to twice that, and never trims the top
// of a thread's arena below it, even for malloc_trim: a model's unpacked
// weights and packed layers, loaded on the control thread, then stayed
// resident after an unload (12-16 MiB of a 16 MiB model, now and then).
// Fixed thresholds: blocks from 4 MiB are mappings of their own, returned
// when freed; an arena keeps at most 4 MiB of free top.
static void FixMallocThresholds() {
  constexpr int kThreshold = 4 << 20;
  mallopt(M_MMAP_THRESHOLD, kThreshold);
  mallopt(M_TRIM_THRESHOLD, kThreshold);
}

int main(int argc, char** argv) {
  FixMallocThresholds();
  absl::SetProgramUsageMessage("mha_server [--model_repository DIR] [--port N] [--metrics_port N]");
  const std::vector<std::string> load_models = mha::server::LoadModelFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return mha::server::Serve(load_models);
}
