// What a call to a method this server does not serve gets: UNIMPLEMENTED
// with a message naming the method (gRPC's own answer has no message, which
// Triton's C++ client library takes for success).
#ifndef MHA_SERVER_FRONTENDS_UNKNOWN_METHODS_H_
#define MHA_SERVER_FRONTENDS_UNKNOWN_METHODS_H_

#include "grpcpp/generic/async_generic_service.h"

namespace mha::server {

// Answers every method no registered service has. Stateless; thread-safe.
class UnknownMethods final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_UNKNOWN_METHODS_H_
