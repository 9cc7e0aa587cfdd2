#include "server/server.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "engine/file_read.h"
#include "engine/large_buffer.h"
#include "engine/status_macros.h"
#include "engine/threads.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"
#include "server/frontends/common/auth.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/grpc/health_reporter.h"
#include "server/frontends/grpc/reflection_v1.h"
#include "server/frontends/grpc/unknown_methods.h"
#include "server/frontends/kserve_grpc/kserve_service.h"
#include "server/frontends/kserve_http/http_routes.h"
#include "server/frontends/kserve_http/http_server.h"
#include "server/frontends/mha_v1/attention_service.h"
#include "server/models/model_control.h"
#include "server/models/model_repository.h"
#include "server/observability/logger.h"
#include "server/observability/memory_held.h"
#include "server/observability/metrics.h"
#include "server/scheduling/heap_trim.h"
#include "server/scheduling/memory_budget.h"
#include "server/scheduling/worker_pool.h"
#include "server/sessions/session_manager.h"
#include "server/sessions/session_spill.h"

namespace mha::server {
namespace {

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

std::string ModelSummary(const ModelRepository& models) {
  std::vector<std::string> parts;
  for (const ModelStatus& status : models.Statuses()) {
    parts.push_back(absl::StrCat(status.name, status.ready ? "" : "(failed)"));
  }
  return absl::StrJoin(parts, ",");
}

// What the loaded model versions hold: their packed weights, and what the
// primitive caches of all of them may hold (one process-wide capacity,
// whatever the number of models).
struct ModelsNeed {
  int64_t weights = 0, primitives = MhaEngine::kPrimitiveCacheBytes;
};
ModelsNeed NeedOf(const ModelRepository& models) {
  ModelsNeed need;
  if (absl::StatusOr<std::vector<VersionPtr>> all = models.Select("", 0); all.ok()) {
    for (const VersionPtr& v : *all) need.weights += v->loaded.engine->WeightBytes();
  }
  return need;
}

// --session_cache_bytes, 0 resolved against what requests could otherwise
// have: `available`, the memory limit beyond the engines' reserve.
int64_t SessionCacheBytes(int64_t flag, int64_t available) {
  constexpr int64_t kDefaultCap = int64_t{512} << 20;
  if (flag > 0) return flag;
  return std::clamp<int64_t>(available / 4, 0, kDefaultCap);
}

// Insecure, TLS, or mutual TLS.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions& o) {
  if (o.tls_cert.empty() && o.tls_key.empty() && o.tls_client_ca.empty()) {
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert.empty() || o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadWholeFile(o.tls_cert));
  ASSIGN_OR_RETURN(pair.private_key, ReadWholeFile(o.tls_key));
  options.pem_key_cert_pairs.push_back(pair);
  if (!o.tls_client_ca.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadWholeFile(o.tls_client_ca));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace

Server::Server(ServerOptions options) : options_(std::move(options)) {}

Server::~Server() { Drain(); }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  std::unique_ptr<Server> server(new Server(std::move(options)));
  RETURN_IF_ERROR(server->Build());
  return server;
}

absl::Status Server::Build() {
  ASSIGN_OR_RETURN(const ModelControlMode mode, ParseModelControlMode(options_.model_control_mode));
  metrics_ = std::make_unique<Metrics>();
  const MemoryLimit limit = ResolveMemoryLimit(options_.memory_limit_bytes);
  memory_source_ = limit.source;
  memory_ = std::make_unique<MemoryBudget>(limit.bytes, &metrics_->memory_reserved());
  metrics_->memory_limit().Set(static_cast<double>(limit.bytes));
  // One pool of engine workers serves every model: threads follow the
  // cores and --workers, never the number of models.
  pool_ = std::make_unique<WorkerPool>(
      WorkerPoolOptions{.workers = options_.workers,
                        .compute_threads = options_.intra_op_threads,
                        .workspace_hold_bytes = WorkspaceHoldBytes(limit.bytes),
                        .memory = memory_.get()});
  // Models warm up for the thread counts the workers' calls use.
  SetCallThreadCounts(pool_->CallThreadCounts());
  models_ = std::make_unique<ModelRepository>(
      options_.model_repository,
      RepositoryOptions{.pool = pool_.get(),
                        .force_batching_off = options_.disable_batching,
                        .memory = memory_.get(),
                        .upload_dir = options_.upload_dir,
                        .single_model_name = options_.model_name},
      *metrics_);
  RETURN_IF_ERROR(LoadAtStart(*models_, mode, options_.load_models));
  // The engines' reserve follows the models: the process as it is now
  // without its models' weights (counted per version), each worker's kept
  // workspaces (two: one for the steps it runs inside a long call), the freed
  // transient buffers kept for reuse (kKeptLargeBytes), the answers sessions
  // keep for a step sent again (each session's most), the primitives of all
  // models (one capacity), then per version its weights, again after every
  // load and unload (UpdateReserve).
  const ModelsNeed need = NeedOf(*models_);
  process_reserve_ = std::max<int64_t>(0, ResidentBytes() - need.weights) +
                     pool_->KeptWorkspaceBytes() + static_cast<int64_t>(kKeptLargeBytes) +
                     options_.max_sessions * kKeptAnswerBytesPerSession;
  const int64_t engine_reserve = process_reserve_ + need.weights + need.primitives;
  session_cache_bytes_ =
      SessionCacheBytes(options_.session_cache_bytes, memory_->limit() - engine_reserve);
  memory_->SetReserve(engine_reserve + session_cache_bytes_);
  metrics_->memory_engine_reserve().Set(static_cast<double>(memory_->reserve()));
  if (memory_->capacity() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--memory_limit_bytes ", WithCommas(memory_->limit()),
        " leaves nothing for requests beyond the engines' reserve and the session cache, ",
        WithCommas(memory_->reserve()), " bytes"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, Credentials(options_));
  ASSIGN_OR_RETURN(BearerAuth auth, BearerAuth::FromFile(options_.auth_token_file));

  try {
    exposer_ =
        std::make_unique<prometheus::Exposer>(HostPort(options_.host, options_.metrics_port));
  } catch (const std::exception& e) {  // CivetServer throws when it cannot listen
    return absl::UnavailableError(absl::StrCat("--metrics_port: cannot serve /metrics on ",
                                               HostPort(options_.host, options_.metrics_port),
                                               " (in use?): ", e.what()));
  }
  exposer_->RegisterCollectable(metrics_->registry());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  health_ = std::make_unique<HealthReporter>(*models_);
  control_ = std::make_unique<ModelControl>(
      *models_, mode,
      absl::Seconds(std::max<int64_t>(1, absl::ToInt64Seconds(options_.repository_poll))), [this] {
        health_->Update();
        UpdateReserve();
      });
  gate_ =
      std::make_unique<FrontEndGate>(*models_, *metrics_,
                                     RequestLimits{.max_tokens = options_.max_request_tokens,
                                                   .max_message_bytes = options_.max_message_bytes},
                                     std::move(auth));
  sessions_ =
      std::make_unique<SessionManager>(SessionOptions{.cache_bytes = session_cache_bytes_,
                                                      .max_sessions = options_.max_sessions,
                                                      .idle_timeout = options_.session_idle_timeout,
                                                      .max_tokens = options_.session_max_tokens},
                                       metrics_->Sessions());
  if (!options_.session_spill_dir.empty()) {
    const absl::Time start = absl::Now();
    const SpillCounts restored = RestoreSessions(*sessions_, *models_, options_.session_spill_dir);
    if (restored.sessions + restored.failed > 0) {
      LogInfo(absl::StrFormat("%d sessions restored from %s in %.0f ms (%d could not come back)",
                              restored.sessions, options_.session_spill_dir,
                              absl::ToDoubleMilliseconds(absl::Now() - start), restored.failed));
    }
  }
  memory_held_ = std::make_shared<MemoryHeldCollector>(
      std::vector<HeldKind>{
          {"weights", [this] { return NeedOf(*models_).weights; }},
          {"workspaces", [this] { return pool_->WorkspaceBytesHeld(); }},
          {"kept_buffers", [] { return static_cast<int64_t>(KeptLargeBytes()); }},
          {"kv_cache", [this] { return sessions_->pool_bytes_held(); }},
          {"session_answers", [this] { return sessions_->kept_answer_bytes(); }},
          {"primitives", [] { return MhaEngine::PrimitiveCacheBytesHeld(); }},
          {"heap_free", [] { return HeapFreeBytes(); }, /*part_of_resident=*/false},
      },
      [] { return ResidentBytes(); });
  exposer_->RegisterCollectable(memory_held_);
  // What small requests leave in the heap goes back too; what the server
  // holds on purpose does not count as the heap's growth.
  StartHeapTrims([held = std::weak_ptr<MemoryHeldCollector>(memory_held_)] {
    const std::shared_ptr<MemoryHeldCollector> collector = held.lock();
    return collector != nullptr ? collector->HeldOnPurpose() : 0;
  });
  service_ = std::make_unique<AttentionServiceImpl>(*gate_, *control_, *sessions_);
  kserve_calls_ = std::make_unique<KserveCalls>(*gate_, *control_, *sessions_);
  kserve_ = std::make_unique<KserveServiceImpl>(*kserve_calls_);
  reflection_v1_ = std::make_unique<ReflectionV1Service>(ServedServiceNames());
  unknown_methods_ = std::make_unique<UnknownMethods>();

  grpc::ServerBuilder builder;
  builder.AddListeningPort(HostPort(options_.host, options_.port), credentials, &grpc_port_);
  // gRPC sets SO_REUSEPORT by default: a second server on this port would
  // then listen beside us and take some of our clients (a wrong answer with
  // OK). Without it, a busy port is refused as the HTTP and metrics ports are.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.RegisterService(service_.get());
  builder.RegisterService(kserve_.get());
  builder.RegisterService(reflection_v1_.get());
  builder.RegisterCallbackGenericService(unknown_methods_.get());
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || grpc_port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--port: cannot serve gRPC on ", HostPort(options_.host, options_.port), " (in use?)"));
  }
  RETURN_IF_ERROR(StartHttp());
  health_->Attach(grpc_server_.get(), /*serving=*/true);
  return absl::OkStatus();
}

absl::Status Server::StartHttp() {
  if (options_.http_port == 0) return absl::OkStatus();
  HttpServerOptions http;
  http.host = options_.host;
  http.port = options_.http_port;
  http.max_body_bytes = static_cast<size_t>(options_.max_message_bytes);
  http.idle_timeout = options_.http_idle_timeout;
  http.cors_origin = options_.http_cors_origin;
  if (!options_.tls_cert.empty()) {
    ASSIGN_OR_RETURN(http.tls_cert_pem, ReadWholeFile(options_.tls_cert));
    ASSIGN_OR_RETURN(http.tls_key_pem, ReadWholeFile(options_.tls_key));
    if (!options_.tls_client_ca.empty()) {
      ASSIGN_OR_RETURN(http.tls_client_ca_pem, ReadWholeFile(options_.tls_client_ca));
    }
  }
  http_routes_ = std::make_unique<KserveHttpRoutes>(*kserve_calls_);
  ASSIGN_OR_RETURN(http_server_, HttpServer::Start(std::move(http), *http_routes_));
  return absl::OkStatus();
}

void Server::UpdateReserve() {
  const ModelsNeed need = NeedOf(*models_);
  memory_->SetReserve(process_reserve_ + need.weights + need.primitives + session_cache_bytes_);
  metrics_->memory_engine_reserve().Set(static_cast<double>(memory_->reserve()));
  if (memory_->capacity() <= 0) {
    LogWarning(absl::StrCat("the models loaded leave no memory for requests: reserve ",
                            WithCommas(memory_->reserve()), " of --memory_limit_bytes ",
                            WithCommas(memory_->limit()),
                            "; every request is refused until models are unloaded"));
  }
}

std::string Server::ReadyLine() const {
  return absl::StrFormat(
      "mha_server ready grpc_port=%d metrics_port=%d http_port=%d models=%s "
      "memory_limit_bytes=%d (%s; engines' reserve and session cache %s) heap=%s",
      grpc_port_, exposer_->GetListeningPorts().front(),
      http_server_ != nullptr ? http_server_->port() : 0, ModelSummary(*models_), memory_->limit(),
      memory_source_, WithCommas(memory_->reserve()), HeapAllocatorName());
}

void Server::StartDraining() {
  if (draining_ || grpc_server_ == nullptr) return;
  draining_ = true;
  health_->StopServing();
  gate_->StartDraining();
  if (http_server_ != nullptr) http_server_->StopAccepting();
  sessions_->StartDraining();  // no new sessions; steps go on until the grace period ends
}

void Server::Drain() {
  if (drained_ || grpc_server_ == nullptr) return;
  StartDraining();
  drained_ = true;
  control_->Stop();  // queued loads answered UNAVAILABLE, so Shutdown does not wait for them
  grpc_server_->Shutdown(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(options_.shutdown_grace));
  sessions_->Stop();
  if (!options_.session_spill_dir.empty()) {  // after the grace period's steps
    const SpillCounts spilled = SpillSessions(*sessions_, options_.session_spill_dir);
    LogInfo(absl::StrFormat("%d sessions written to %s (%d failed)", spilled.sessions,
                            options_.session_spill_dir, spilled.failed));
  }
  models_->Stop();
  // Every HTTP request handed over has been answered now (the batchers
  // refused what was left); the connections close.
  if (http_server_ != nullptr) http_server_->Stop(absl::Seconds(5));
  grpc_server_->Wait();
  health_->Attach(nullptr, false);
}

}  // namespace mha::server
