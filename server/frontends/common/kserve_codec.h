// The KServe v2 / Open Inference Protocol messages to the engine's request
// and back: ModelInfer goes through the checks, batcher and engine of
// Attend, with errors in KServe's words. No gRPC calls here: pure message
// conversion.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_CODEC_H_
#define MHA_SERVER_FRONTENDS_KSERVE_CODEC_H_

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/model_config.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/common/request_codec.h"
#include "server/frontends/common/session_codec.h"
#include "server/frontends/common/shared_memory.h"

namespace mha::server {

// Output tensor names of ModelInfer.
inline constexpr char kOutputName[] = "output";
inline constexpr char kWeightsName[] = "attn_weights";
// Triton's tensor parameters naming a shared-memory slice.
inline constexpr char kShmRegion[] = "shared_memory_region";
inline constexpr char kShmByteSize[] = "shared_memory_byte_size";
inline constexpr char kShmOffset[] = "shared_memory_offset";
// `size` bytes at `data`, as the byte span shared memory and the engine take.
inline absl::Span<const uint8_t> AsBytes(const void* data, size_t size) {
  return absl::MakeConstSpan(static_cast<const uint8_t*>(data), size);
}
// A KServe model_version: "" -> 0 (the newest ready one), else a positive
// decimal number; NOT_FOUND for anything else.
absl::StatusOr<int64_t> ParseModelVersion(const std::string& model, const std::string& version);

// Triton's request parameters about the call itself.
struct InferCallParameters {
  // `timeout` (int64, microseconds; 0 or absent: none): the request's
  // deadline is the earlier of this and the gRPC deadline.
  absl::Duration timeout = absl::InfiniteDuration();
  // `priority` (uint64): Triton's rule, 1 is the highest level, 0 (or one
  // above the model's priority_levels) the model's default level.
  uint64_t priority = 0;
  // `triton_enable_empty_final_response`: on a stream, each response says
  // whether it is its request's last (`triton_final_response`), as Triton's
  // streaming clients wait for. Every request here has one response.
  bool final_response_flag = false;
  // Triton's sequence parameters: `sequence_id` (int64, uint64 or string;
  // 0 or "": not a sequence request), `sequence_start`, `sequence_end`
  // (bool). A sequence is a session on the model's KV cache.
  struct Sequence {
    std::string id;  // decimal for a number: 42 and "42" are one sequence
    bool start = false, end = false;
  };
  std::optional<Sequence> sequence;
};
absl::StatusOr<InferCallParameters> ReadCallParameters(const inference::ModelInferRequest& request);

// A requested output: its name, and the shared-memory slice it goes to
// when the request placed it there (else it goes in raw_output_contents).
struct RequestedOutput {
  std::string name;
  std::optional<SharedMemorySlice> shared_memory;
};

// Maps inputs by name (query, key, value, key_padding_mask, attn_mask;
// datatypes FP32, BF16, FP16, BOOL; raw_input_contents or typed contents,
// viewed where they are, not copied), the bool parameters is_causal /
// need_weights / per_head_weights, and checks them against `dims` as
// Attend does. `request` must outlive the result. `outputs` receives the
// outputs to return, in order. Errors are INVALID_ARGUMENT (or
// RESOURCE_EXHAUSTED above `limits`) and name KServe datatypes.
//
// Triton's shared memory: an input or requested output with the parameters
// `shared_memory_region` (string), `shared_memory_byte_size` and
// `shared_memory_offset` (int64) is read from (written to) that slice of a
// region of `shared_memory` (null: none registered); an input's byte size
// must be its shape's, at most limits.max_message_bytes, and an output's
// slice must hold the output. raw_input_contents then has one entry per
// input not in shared memory.
// `received`: where each raw_input_contents entry arrived when the message
// was read around them (proto/wire/; null entries and a null vector: in the
// message itself).
using RawReceived = std::vector<const ReceivedBytes*>;
absl::StatusOr<AttentionRequest> DecodeInferRequest(const inference::ModelInferRequest& request,
                                                    const AttentionDims& dims,
                                                    const RequestLimits& limits,
                                                    const SharedMemoryRegistry* shared_memory,
                                                    std::vector<RequestedOutput>& outputs,
                                                    const RawReceived* received = nullptr);

// The inputs, parameters and requested outputs of `request`: where every
// decoder here starts. Inputs converted from other dtypes live in
// `converted`.
absl::Status ReadRequest(const inference::ModelInferRequest& request,
                         const SharedMemoryRegistry* shared_memory, const RequestLimits& limits,
                         RequestInputs& in, std::deque<std::string>& converted,
                         std::vector<RequestedOutput>& outputs,
                         const RawReceived* received = nullptr);

// In kserve_sequence_codec.cc:
// A sequence request's inputs: its query as a session step's ([1, T, E]
// or [T, E]), and, on the start request of a cross-attention sequence, the
// memory (key, with value and key_padding_mask when given). attn_mask,
// is_causal and per_head_weights are refused (a sequence attends to every
// earlier token of itself, or to its memory), as are key and value after
// the start. `request` must outlive the result; `outputs` as for
// DecodeInferRequest.
struct SequenceInputs {
  AttentionRequest query;
  std::optional<AttentionRequest> memory;
};
absl::StatusOr<SequenceInputs> DecodeSequenceRequest(const inference::ModelInferRequest& request,
                                                     const AttentionDims& dims,
                                                     const RequestLimits& limits,
                                                     const SharedMemoryRegistry* shared_memory,
                                                     bool start,
                                                     std::vector<RequestedOutput>& outputs);

// An end without tokens: a sequence_end request (not a start) whose query is
// [1, 0, E] or [0, E] only ends the sequence (an extension: Triton cannot
// end a sequence without a last request). The layout of its empty answer;
// nullopt when the query has tokens (decode it with DecodeSequenceRequest);
// INVALID_ARGUMENT for anything else beside the empty query.
absl::StatusOr<std::optional<StepLayout>> DecodeEmptyEnd(
    const inference::ModelInferRequest& request, const AttentionDims& dims,
    const RequestLimits& limits, const SharedMemoryRegistry* shared_memory,
    std::vector<RequestedOutput>& outputs);

// The response: the requested outputs, raw little-endian bytes (an empty
// raw entry for one written to shared memory, as Triton, so that entries
// and outputs keep one index), and the version that computed them. Fails
// when a shared-memory output cannot be written or does not fit its slice.
// With `deferred`, an output sent inline is left as an empty raw entry and
// listed there instead, for a writer that fills it straight into the
// message's bytes (wire_writer.h); `result` must outlive that, or `owner`
// (the result's, which keeps `values` alive) be held.
struct DeferredOutput {
  int raw_index = 0;
  absl::Span<const float> values;
  DType dtype = DType::kF32;
  std::shared_ptr<const void> owner;  // may be null
  ConvertedOutput converted;          // `values` in `dtype`, when the worker made it
};
absl::Status FillInferResponse(const inference::ModelInferRequest& request, int64_t version,
                               const std::vector<RequestedOutput>& outputs,
                               const ResultLayout& layout, const AttentionResult& result,
                               inference::ModelInferResponse* response,
                               std::vector<DeferredOutput>* deferred = nullptr);

// A sequence step's response: `output` in the query's dtype and shape,
// `attn_weights` [1, T, K'] (or [T, K']) over every key the step saw.
absl::Status FillSequenceResponse(const inference::ModelInferRequest& request, int64_t version,
                                  const std::vector<RequestedOutput>& outputs,
                                  const StepLayout& layout, const StepResult& result,
                                  inference::ModelInferResponse* response);

// Inputs and outputs of a model with these dimensions, and its ready
// versions; -1 marks batch and sequence lengths.
void DescribeModel(const std::string& name, const AttentionDims& dims,
                   const std::vector<int64_t>& versions,
                   inference::ModelMetadataResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_CODEC_H_
