// Decoding KServe sequence requests (Triton's sequences, our sessions):
// DecodeSequenceRequest and DecodeEmptyEnd, declared in kserve_codec.h.
#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "server/frontends/common/kserve_codec.h"

namespace mha::server {

absl::StatusOr<SequenceInputs> DecodeSequenceRequest(const inference::ModelInferRequest& request,
                                                     const AttentionDims& dims,
                                                     const RequestLimits& limits,
                                                     const SharedMemoryRegistry* shared_memory,
                                                     bool start,
                                                     std::vector<RequestedOutput>& outputs) {
  auto converted = std::make_shared<std::deque<std::string>>();
  RequestInputs in;
  RETURN_IF_ERROR(ReadRequest(request, shared_memory, limits, in, *converted, outputs));
  if (in.attn_mask.has_value() || in.is_causal || in.per_head_weights) {
    return absl::InvalidArgumentError(
        "a sequence request takes no attn_mask, is_causal or per_head_weights: its tokens "
        "attend to every earlier token of the sequence (a cross-attention sequence's, to its "
        "memory), as a session's Append");
  }
  const bool memory = in.key.has_value() || in.value.has_value() || in.key_padding_mask.has_value();
  if (memory && !start) {
    return absl::InvalidArgumentError(
        "key, value and key_padding_mask go on the sequence_start request only (they are a "
        "cross-attention sequence's memory)");
  }
  if (memory && !in.key.has_value()) {
    return absl::InvalidArgumentError(
        "value and key_padding_mask need a key (a cross-attention sequence's memory)");
  }
  ASSIGN_OR_RETURN(AttentionRequest query,
                   StepQuery(dims, in.query, in.need_weights, limits, DTypeSpelling::kKserve));
  if (!converted->empty()) query.KeepAlive(converted);
  SequenceInputs decoded{std::move(query), std::nullopt};
  if (memory) {
    ASSIGN_OR_RETURN(AttentionRequest m, MemoryRequest(dims, in, limits, DTypeSpelling::kKserve));
    if (!converted->empty()) m.KeepAlive(converted);
    decoded.memory.emplace(std::move(m));
  }
  return decoded;
}

absl::StatusOr<std::optional<StepLayout>> DecodeEmptyEnd(
    const inference::ModelInferRequest& request, const AttentionDims& dims,
    const RequestLimits& limits, const SharedMemoryRegistry* shared_memory,
    std::vector<RequestedOutput>& outputs) {
  const auto& inputs = request.inputs();
  auto query =
      std::find_if(inputs.begin(), inputs.end(), [](auto& i) { return i.name() == "query"; });
  if (query == inputs.end() || query->shape_size() < 2 ||
      query->shape(query->shape_size() - 2) != 0) {
    return std::nullopt;
  }
  std::deque<std::string> converted;
  RequestInputs in;
  RETURN_IF_ERROR(ReadRequest(request, shared_memory, limits, in, converted, outputs));
  if (in.key.has_value() || in.value.has_value() || in.key_padding_mask.has_value() ||
      in.attn_mask.has_value() || in.is_causal || in.per_head_weights) {
    return absl::InvalidArgumentError("an end without tokens takes only its empty query");
  }
  const std::vector<int64_t>& shape = in.query.shape;
  if (!(shape.size() == 2 || (shape.size() == 3 && shape[0] == 1)) ||
      shape.back() != dims.embed_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("query: an end without tokens is [1, 0, E] or [0, E], E = ", dims.embed_dim,
                     "; got [", absl::StrJoin(shape, ", "), "]"));
  }
  return StepLayout{shape, in.query.dtype, in.need_weights};
}

}  // namespace mha::server
