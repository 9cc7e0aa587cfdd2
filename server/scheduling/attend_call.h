// One Attend request as the scheduler carries it: the task that owns the
// decoded request and answers exactly once.
#ifndef MHA_SERVER_SCHEDULING_ATTEND_CALL_H_
#define MHA_SERVER_SCHEDULING_ATTEND_CALL_H_

#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/dtype.h"
#include "engine/ragged_batch.h"
#include "server/scheduling/task.h"

namespace mha::server {

// A result's output already in the dtype it leaves in (FP16 or BF16),
// converted in the pass that checked it finite; `bytes` empty when it was
// not (a front end then converts the f32 output itself).
struct ConvertedOutput {
  DType dtype = DType::kF32;
  absl::Span<const uint8_t> bytes;
  std::shared_ptr<const void> owner;  // keeps `bytes` alive
};

// Whether `converted` holds `values` in `dtype`, to be sent in their place.
inline bool IsConvertedFrom(const ConvertedOutput& converted, absl::Span<const float> values,
                            DType dtype) {
  return !converted.bytes.empty() && converted.dtype == dtype &&
         converted.bytes.size() == values.size() * DTypeSize(dtype);
}

// What a computed request gets back: its f32 output and optional weights,
// in the shapes its AttentionRequest gives, as views of the engine call's
// outputs: valid during Respond only (encode them there), or for as long
// as a copy of `owner` is held, when it is set (a response may then send
// f32 bytes from where the engine wrote them, with no copy).
struct AttentionResult {
  absl::Span<const float> output;
  absl::Span<const float> weights;
  std::shared_ptr<const void> owner;  // may be null
  ConvertedOutput converted;
};

// Owns one Attend request from the front end that decoded it to its
// answer: the input, what it costs and where those bytes are reserved, its
// deadline. Whoever ends it (the front end refusing it, the batcher dropping
// or computing it) calls Respond or Fail; the first call answers, later ones
// do nothing, so a call is answered exactly once. Subclasses (one per front
// end and transport) say how a result is encoded and how the answer leaves.
// Not thread-safe: one owner at a time (front end, queue, worker).
class AttendCall : public Task {
 public:
  AttendCall() : Task(Kind::kAttend) {}

  // The decoded request, set once before the call is queued.
  void SetInput(AttentionRequest input) {
    input_.emplace(std::move(input));
    signature_ = BatchSignature::Of(*input_);
    wire_bytes = input_->wire_bytes();
  }
  const AttentionRequest& input() const { return *input_; }
  // The engine call that computed it took this long (set by the worker
  // before Prepare; zero until then): the front ends report it.
  absl::Duration compute_time = absl::ZeroDuration();
  // Which requests it may share an engine call with.
  const BatchSignature& signature() const { return signature_; }

  // Answers with `result`: encodes it (its error instead when encoding
  // fails) and ends the call. Counts no success: the batcher's path is
  // Prepare, the call's record, then Answer.
  void Respond(const AttentionResult& result) {
    if (!once_.answered()) Answer(Prepare(result));
  }
  // The two halves of Respond, for answers whose statistics are recorded
  // between them, before any leaves. Prepare encodes `result` and says
  // whether the answer will be OK (RESOURCE_EXHAUSTED when it runs out of
  // memory); Answer ends the call with what Prepare said, or an error.
  absl::Status Prepare(const AttentionResult& result) {
    try {
      return Encode(result);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("out of memory encoding the response; retry later");
    }
  }
  void Answer(const absl::Status& status) {
    if (!once_.Claim()) return;
    if (!status.ok()) CountFailure();
    Finish(status);
  }
  // Answers with an error (never OK).
  void Fail(const absl::Status& status) final { Answer(AnswerOnce::AsFailure(status)); }
  // Whether Encode sends a large FP16 or BF16 output from
  // AttentionResult::converted when it is there (the worker converts it
  // then, in the pass that checks it); false: it converts the f32 output.
  virtual bool SendsConvertedOutput() const { return false; }
  bool answered() const { return once_.answered(); }
  void CountDropped(const ModelMetrics& model, const char* reason) final {
    model.CountDropped(reason);
  }

 protected:
  // Writes `result` into the response, or says why it could not (may
  // throw std::bad_alloc).
  virtual absl::Status Encode(const AttentionResult& result) = 0;
  // Ends the call with `status` (OK after Encode); called exactly once.
  virtual void Finish(const absl::Status& status) = 0;

 private:
  std::optional<AttentionRequest> input_;
  BatchSignature signature_;
  AnswerOnce once_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SCHEDULING_ATTEND_CALL_H_
