// Keeps grpc.health.v1 in step with the repository while models come and go.
#ifndef MHA_SERVER_FRONTENDS_HEALTH_REPORTER_H_
#define MHA_SERVER_FRONTENDS_HEALTH_REPORTER_H_

#include <set>
#include <string>

#include "engine/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/models/model_repository.h"

namespace mha::server {

// The service "" is SERVING while the server serves; each model's name is
// SERVING while the server serves and one of its versions is ready, and
// NOT_SERVING once it failed or was unloaded. Borrows the repository and
// (after Attach) the server. Thread-safe.
class HealthReporter {
 public:
  explicit HealthReporter(const ModelRepository& models) : models_(models) {}

  // Reports to `server`'s health service from now on (null: nowhere).
  void Attach(grpc::Server* server, bool serving);
  // Re-reads the repository and reports.
  void Update();
  // From now on everything is NOT_SERVING (draining).
  void StopServing();

 private:
  void ReportLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ModelRepository& models_;
  Mutex mu_;
  grpc::Server* server_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> named_ ABSL_GUARDED_BY(mu_);  // every model name reported
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_HEALTH_REPORTER_H_
