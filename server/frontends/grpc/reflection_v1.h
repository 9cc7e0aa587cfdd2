// grpc.reflection.v1.ServerReflection: what newer reflection clients ask
// for first (Debian's gRPC 1.51 serves only v1alpha). Answers from the
// process's generated descriptor pool, which holds every proto linked in.
#ifndef MHA_SERVER_FRONTENDS_REFLECTION_V1_H_
#define MHA_SERVER_FRONTENDS_REFLECTION_V1_H_

#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace mha::server {

// Owns the list of service names it reports. Thread-safe (each stream's
// state lives in its handler call).
class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::Service {
 public:
  explicit ReflectionV1Service(std::vector<std::string> services)
      : services_(std::move(services)) {}

  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<grpc::reflection::v1::ServerReflectionResponse,
                               grpc::reflection::v1::ServerReflectionRequest>* stream) override;

 private:
  const std::vector<std::string> services_;
};

// The services of this server, for list_services (reflection included),
// with their descriptors linked in: grpc.health.v1 and both reflections.
std::vector<std::string> ServedServiceNames();

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_REFLECTION_V1_H_
