// Triton's sequences on the session KV cache: a ModelInfer request with
// sequence_id (and sequence_start / sequence_end) is a session step, in the
// same registry, admission and metrics as mha.v1's sessions.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_SEQUENCES_H_
#define MHA_SERVER_FRONTENDS_KSERVE_SEQUENCES_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/common/kserve_codec.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// The session a model's sequence is: "sequence/<model>/<id>". mha.v1's
// session ids cannot hold '/', so no OpenSession takes one of these ids.
std::string SequenceSessionId(const std::string& model, const std::string& sequence_id);

// Borrows the front-end gate (auth, repository, limits, draining), the session
// manager and the shared-memory registry, which outlive it. Thread-safe.
//
// A start request ends the sequence of that id if one is open (Triton's
// rule), opens a session (a cross-attention one when it carries a key) on
// the version it names, and appends its query; a failed start leaves no
// session. A later request appends; an id that is not open is
// INVALID_ARGUMENT with the reason (never opened, closed, evicted,
// expired). The end request is computed, then the session closes, whatever
// the step's outcome.
class SequenceCalls {
 public:
  using Done = std::function<void(const absl::Status&)>;

  // `shared_memory` (may be null) is the registry requests name regions of.
  SequenceCalls(FrontEndGate& gate, SessionManager& sessions,
                const SharedMemoryRegistry* shared_memory)
      : gate_(gate), sessions_(sessions), shared_memory_(shared_memory) {}

  // Runs `request` (read as `parameters`, whose `sequence` is set) and fills
  // `response`; `done` is called exactly once, after that (on a worker, or
  // at once when refused). `request` and `response` live until then;
  // `deadline` bounds the step as an Attend request's, `cancelled` says
  // whether its client is gone; `authorization` is the caller's
  // Authorization value.
  void Infer(absl::string_view authorization, std::function<bool()> cancelled,
             const inference::ModelInferRequest& request, const InferCallParameters& parameters,
             absl::Time deadline, inference::ModelInferResponse* response, Done done);

 private:
  struct Step;
  // Decodes a start request, ends an open sequence of its id and opens the
  // session; the step to append, or why not. `found`: the model version,
  // once known (a refusal after that counts in its statistics).
  absl::StatusOr<std::shared_ptr<Step>> Start(const inference::ModelInferRequest& request,
                                              const std::string& id, VersionPtr& found);
  // Decodes a later request of the open session `id` (`found` as Start's);
  // with `end`, it may be an end without tokens (a Step with no append).
  absl::StatusOr<std::shared_ptr<Step>> Continue(const inference::ModelInferRequest& request,
                                                 const std::string& id,
                                                 const std::string& sequence_id, bool end,
                                                 VersionPtr& found);

  FrontEndGate& gate_;
  SessionManager& sessions_;
  const SharedMemoryRegistry* const shared_memory_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_SEQUENCES_H_
