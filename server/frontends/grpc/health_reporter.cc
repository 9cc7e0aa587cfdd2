#include "server/frontends/grpc/health_reporter.h"

#include <vector>

#include "grpcpp/health_check_service_interface.h"

namespace mha::server {

void HealthReporter::Attach(grpc::Server* server, bool serving) {
  MutexLock lock(mu_);
  server_ = server;
  serving_ = serving;
  ReportLocked();
}

void HealthReporter::Update() {
  MutexLock lock(mu_);
  ReportLocked();
}

void HealthReporter::StopServing() {
  MutexLock lock(mu_);
  serving_ = false;
  ReportLocked();
}

void HealthReporter::ReportLocked() {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", serving_);
  const std::vector<std::string> ready = models_.Ready();
  const std::set<std::string> ready_set(ready.begin(), ready.end());
  for (const ModelStatus& status : models_.Statuses()) named_.insert(status.name);
  for (const std::string& name : named_) {
    health->SetServingStatus(name, serving_ && ready_set.count(name) > 0);
  }
}

}  // namespace mha::server
