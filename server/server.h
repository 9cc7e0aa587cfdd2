// The whole server as one object: what it is configured with, building and
// starting it (models loaded, memory budgeted, ports open), and draining it.
// main.cc only reads flags into ServerOptions.
#ifndef MHA_SERVER_SERVER_H_
#define MHA_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class Server;
}  // namespace grpc
namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace mha::server {

class FrontEndGate;
class AttentionServiceImpl;
class HealthReporter;
class HttpServer;
class KserveHttpRoutes;
class KserveCalls;
class KserveServiceImpl;
class MemoryBudget;
class MemoryHeldCollector;
class Metrics;
class ModelControl;
class ModelRepository;
class ReflectionV1Service;
class SessionManager;
class UnknownMethods;
class WorkerPool;

// Every setting of a server; the flags of mha_server map one to one (see
// the README's configuration reference).
struct ServerOptions {
  std::string model_repository = "models";
  // The model's name when model_repository is itself one model's folder
  // ("": the folder's name).
  std::string model_name;
  std::string host = "0.0.0.0";
  int port = 50051;              // 0: a free one
  int metrics_port = 9464;       // 0: a free one
  int http_port = 8000;          // KServe v2 over HTTP/REST; 0: off
  std::string http_cors_origin;  // "": no CORS headers
  absl::Duration http_idle_timeout = absl::Seconds(60);
  int max_message_bytes = 64 << 20;
  int workers = 2;
  int intra_op_threads =
      0;  // 0: all cores alone, cores / workers beside others (WorkerPoolOptions)
  absl::Duration shutdown_grace = absl::Seconds(30);
  bool disable_batching = false;
  int64_t max_request_tokens = int64_t{1} << 20;
  int64_t memory_limit_bytes = 0;  // 0: from the cgroup, RLIMIT_AS or physical memory
  std::string tls_cert, tls_key, tls_client_ca;
  std::string model_control_mode = "none";
  absl::Duration repository_poll = absl::Seconds(15);
  // Where models sent over the API are written while they load ("": $TMPDIR or /tmp).
  std::string upload_dir;
  std::vector<std::string> load_models;
  int64_t session_cache_bytes = 0;  // 0: from the memory limit
  // Where sessions are written at shutdown and read back at start ("": not kept).
  std::string session_spill_dir;
  int64_t max_sessions = 1024;
  absl::Duration session_idle_timeout = absl::Seconds(60);
  int64_t session_max_tokens = 8192;
  std::string auth_token_file;
};

// Owns the object graph of one server: metrics, the memory budget, the
// worker pool, the model repository and its control, the front-end gate, the
// sessions, the gRPC services and server, the metrics endpoint. Start and
// Drain are called from one thread (main's); the server itself serves from
// gRPC's threads and the pool's.
class Server {
 public:
  // Loads the models, sets the memory reserve, opens the ports and starts
  // serving. An error says what is wrong (a flag, a model, a port).
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();  // Drain(), if not done

  // The line that tells a supervisor (and the tests) the server serves.
  std::string ReadyLine() const;
  // Not serving from now on: health says so, new calls and sessions are
  // refused; what is queued and in flight goes on.
  void StartDraining();
  // StartDraining, then up to the grace period for what is queued and in
  // flight, then stops everything.
  void Drain();

 private:
  explicit Server(ServerOptions options);
  absl::Status Build();
  // The HTTP front end on --http_port (with the gRPC port's TLS files).
  absl::Status StartHttp();
  // Sets the memory budget's reserve for the models loaded now (after a
  // load or an unload).
  void UpdateReserve();

  const ServerOptions options_;
  std::string memory_source_;  // where the memory limit came from
  // The reserve's parts that do not follow the models (set by Build).
  int64_t process_reserve_ = 0, session_cache_bytes_ = 0;
  int grpc_port_ = 0;
  bool draining_ = false, drained_ = false;
  // In construction order (destroyed in reverse).
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MemoryBudget> memory_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<HealthReporter> health_;
  std::unique_ptr<ModelControl> control_;
  std::unique_ptr<FrontEndGate> gate_;
  std::unique_ptr<SessionManager> sessions_;
  // Read by the exposer at each scrape (it holds a weak pointer): gone
  // before what it reads.
  std::shared_ptr<MemoryHeldCollector> memory_held_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<KserveCalls> kserve_calls_;
  std::unique_ptr<KserveServiceImpl> kserve_;
  std::unique_ptr<ReflectionV1Service> reflection_v1_;
  std::unique_ptr<UnknownMethods> unknown_methods_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<KserveHttpRoutes> http_routes_;
  std::unique_ptr<HttpServer> http_server_;  // null with --http_port 0
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVER_H_
