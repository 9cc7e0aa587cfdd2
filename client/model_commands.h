// mha_client's model commands: what a server holds and what it serves.
#ifndef MHA_CLIENT_MODEL_COMMANDS_H_
#define MHA_CLIENT_MODEL_COMMANDS_H_

#include <functional>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::client {

// A new call's context (its deadline and token set).
using ContextFactory = std::function<std::unique_ptr<grpc::ClientContext>()>;

// grpc.health.v1 Check of the server ("") or of one model: 0 when SERVING.
// An unknown model is named, with the models the server has.
int Health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
           const ContextFactory& context);
// One line per model: its state, shape, layout, parameters and versions.
int Models(v1::AttentionService::Stub& stub, const ContextFactory& context);
// GetModel's ModelInfo, as text.
int Info(v1::AttentionService::Stub& stub, const std::string& name, const ContextFactory& context);
// `load_model NAME` / `unload_model NAME` (--model_control_mode poll or
// explicit on the server): waits for the load, then prints the versions.
int ControlModel(v1::AttentionService::Stub& stub, bool load, const std::string& name,
                 const ContextFactory& context);

}  // namespace mha::client

#endif  // MHA_CLIENT_MODEL_COMMANDS_H_
