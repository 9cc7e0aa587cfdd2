#include "server/frontends/common/kserve_sequences.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/mutex.h"
#include "engine/status_macros.h"

namespace mha::server {

std::string SequenceSessionId(const std::string& model, const std::string& sequence_id) {
  return absl::StrCat("sequence/", model, "/", sequence_id);
}

// One decoded sequence request: the step, the session to open first (a
// start), and what the response needs.
struct SequenceCalls::Step {
  Step(std::optional<StepParams> params, std::vector<RequestedOutput> outputs)
      : append(std::move(params)), outputs(std::move(outputs)) {}

  std::optional<StepParams> append;  // none: an end without tokens
  std::optional<OpenParams> open;
  std::vector<RequestedOutput> outputs;
  StepLayout layout;
};

absl::StatusOr<std::shared_ptr<SequenceCalls::Step>> SequenceCalls::Start(
    const inference::ModelInferRequest& request, const std::string& id, VersionPtr& found) {
  ASSIGN_OR_RETURN(const int64_t number,
                   ParseModelVersion(request.model_name(), request.model_version()));
  ASSIGN_OR_RETURN(VersionPtr version, gate_.models().Find(request.model_name(), number));
  found = version;
  std::vector<RequestedOutput> outputs;
  ASSIGN_OR_RETURN(SequenceInputs in,
                   DecodeSequenceRequest(request, version->loaded.dims, gate_.limits(),
                                         shared_memory_, /*start=*/true, outputs));
  // Triton's rule: a start on an id still open ends that sequence first.
  (void)sessions_.Close(id);
  OpenParams open;
  open.version = version;
  open.id = id;
  open.memory = std::move(in.memory);
  auto step = std::make_shared<Step>(
      StepParams{id, std::move(in.query), std::nullopt, std::move(version)}, std::move(outputs));
  step->open.emplace(std::move(open));
  return step;
}

absl::StatusOr<std::shared_ptr<SequenceCalls::Step>> SequenceCalls::Continue(
    const inference::ModelInferRequest& request, const std::string& id,
    const std::string& sequence_id, bool end, VersionPtr& found) {
  absl::StatusOr<VersionPtr> version = sessions_.VersionOf(id);
  if (!version.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", sequence_id, " of model ", request.model_name(), " is not open (",
                     version.status().message(),
                     "): a sequence begins with a request that sets sequence_start"));
  }
  found = *version;
  std::vector<RequestedOutput> outputs;
  if (end) {
    ASSIGN_OR_RETURN(
        std::optional<StepLayout> empty,
        DecodeEmptyEnd(request, (*version)->loaded.dims, gate_.limits(), shared_memory_, outputs));
    if (empty.has_value()) {
      auto step = std::make_shared<Step>(std::nullopt, std::move(outputs));
      step->layout = *std::move(empty);
      return step;
    }
  }
  ASSIGN_OR_RETURN(SequenceInputs in,
                   DecodeSequenceRequest(request, (*version)->loaded.dims, gate_.limits(),
                                         shared_memory_, /*start=*/false, outputs));
  return std::make_shared<Step>(
      StepParams{id, std::move(in.query), std::nullopt, *std::move(version)}, std::move(outputs));
}

void SequenceCalls::Infer(absl::string_view authorization, std::function<bool()> cancelled,
                          const inference::ModelInferRequest& request,
                          const InferCallParameters& parameters, absl::Time deadline,
                          inference::ModelInferResponse* response, Done done) {
  const InferCallParameters::Sequence& sequence = *parameters.sequence;
  const std::string id = SequenceSessionId(request.model_name(), sequence.id);
  const absl::Time received = absl::Now();
  VersionPtr found;
  absl::StatusOr<std::shared_ptr<Step>> decoded = [&]() -> absl::StatusOr<std::shared_ptr<Step>> {
    // A new sequence is new work (refused while draining); a started one
    // steps on until the grace period ends, as a session's steps.
    RETURN_IF_ERROR(sequence.start ? gate_.Admit(authorization) : gate_.Authorize(authorization));
    return sequence.start ? Start(request, id, found)
                          : Continue(request, id, sequence.id, sequence.end, found);
  }();
  if (!decoded.ok()) {
    // Refused before its step is queued: counted once, as a failure of
    // the version it names (an unknown model or sequence has none).
    if (found != nullptr) found->CountRefusal(received);
    return done(decoded.status());
  }
  std::shared_ptr<Step> step = *std::move(decoded);
  if (!step->append.has_value()) {
    // An end without tokens closes the sequence (as CloseSession closes a
    // session) and answers empty outputs.
    (void)sessions_.Close(id);
    return done(FillSequenceResponse(request, found->version, step->outputs, step->layout,
                                     StepResult{}, response));
  }
  StepParams& append = *step->append;
  append.deadline = deadline;
  append.cancelled = std::move(cancelled);
  step->layout = StepLayout::Of(append);
  const int64_t version = append.decoded_for->version;

  // The answer, once both the open (a start) and the step have answered:
  // the open's error if it failed, else the step's. A start whose step
  // failed leaves no session; an end closes it whatever happened.
  struct Join {
    explicit Join(int answers) : left(answers) {}
    Mutex mu;
    int left ABSL_GUARDED_BY(mu);
    absl::Status open ABSL_GUARDED_BY(mu);
    absl::Status step ABSL_GUARDED_BY(mu);
  };
  auto join = std::make_shared<Join>(step->open.has_value() ? 2 : 1);
  const bool start = sequence.start, end = sequence.end;
  auto arrived = [this, join, id, start, end, done](absl::Status status, bool is_open) {
    absl::Status answer;
    {
      MutexLock lock(join->mu);
      (is_open ? join->open : join->step) = std::move(status);
      if (--join->left > 0) return;
      answer = join->open.ok() ? join->step : join->open;
    }
    if (end || (start && !answer.ok())) (void)sessions_.Close(id);
    done(answer);
  };
  if (step->open.has_value()) {
    // The step is queued right behind the open, before the next request
    // of a stream is read, so a sequence's steps keep their order; a
    // cross session's step waits for its memory to be projected.
    sessions_.Open(*std::move(step->open), [arrived](absl::StatusOr<SessionInfo> info) {
      arrived(info.status(), /*is_open=*/true);
    });
  }
  sessions_.Step(std::move(append), [step, arrived, &request, version,
                                     response](absl::StatusOr<StepResult> r) {
    absl::Status status = r.status();
    if (r.ok()) {
      status = FillSequenceResponse(request, version, step->outputs, step->layout, *r, response);
    }
    arrived(std::move(status), /*is_open=*/false);
  });
}

}  // namespace mha::server
