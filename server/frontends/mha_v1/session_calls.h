// The work of the session RPCs (authorize, decode, hand to the session
// manager, encode), shared by the unary RPCs and the Stream RPC's messages.
#ifndef MHA_SERVER_FRONTENDS_SESSION_CALLS_H_
#define MHA_SERVER_FRONTENDS_SESSION_CALLS_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/common/session_codec.h"
#include "server/frontends/grpc/grpc_helpers.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// Borrows the front-end gate (auth, repository, limits) and the session manager,
// which outlive it. Thread-safe. `done` is called exactly once, after the
// response is filled (on the worker that computed the step, or at once when
// refused);
// `keep_alive` (may be null) owns the request's bytes until then.
class SessionCalls {
 public:
  using Done = std::function<void(const absl::Status&)>;

  SessionCalls(FrontEndGate& gate, SessionManager& sessions) : gate_(gate), sessions_(sessions) {}

  void Open(const grpc::CallbackServerContext& context, const v1::OpenSessionRequest& request,
            std::shared_ptr<const void> keep_alive, v1::Session* response, Done done);
  void Append(const grpc::CallbackServerContext& context, const v1::AppendRequest& request,
              std::shared_ptr<const void> keep_alive, v1::AppendResponse* response, Done done);
  // The same for a request read around its query's bytes (`query_data`:
  // where they are, or null: in the message), answered by `encode` (on the
  // worker, while the result's views are valid) before `done`.
  using EncodeStep = std::function<absl::Status(const StepLayout&, const StepResult&)>;
  void Append(const grpc::CallbackServerContext& context, const v1::AppendRequest& request,
              const ReceivedBytes* query_data, std::shared_ptr<const void> keep_alive,
              EncodeStep encode, Done done);
  absl::Status Fork(const grpc::CallbackServerContext& context,
                    const v1::ForkSessionRequest& request, v1::Session* response);
  absl::Status Close(const grpc::CallbackServerContext& context,
                     const v1::CloseSessionRequest& request, v1::CloseSessionResponse* response);
  absl::Status List(const grpc::CallbackServerContext& context,
                    const v1::ListSessionsRequest& request, v1::ListSessionsResponse* response);

 private:
  FrontEndGate& gate_;
  SessionManager& sessions_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_SESSION_CALLS_H_
