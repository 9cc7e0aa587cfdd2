#include "server/frontends/common/session_codec.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"

namespace mha::server {
namespace {

bool ValidSessionId(const std::string& id) {
  if (id.size() > kMaxSessionIdLength) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// AttentionRequest names the memory's tensors as Attend's key, value and
// key_padding_mask: the message says what OpenSession calls them.
absl::Status RenameMemoryFields(const absl::Status& status) {
  const std::string message(status.message());
  for (const auto& [from, to] :
       {std::pair<const char*, const char*>{"key_padding_mask", "memory_key_padding_mask"},
        {"key", "memory"},
        {"value", "memory_value"}}) {
    if (absl::StartsWith(message, absl::StrCat(from, ":")) ||
        absl::StartsWith(message, absl::StrCat(from, " "))) {
      return absl::Status(status.code(), absl::StrCat(to, message.substr(strlen(from))));
    }
  }
  return status;
}

}  // namespace

absl::Status CheckSessionId(const std::string& id, const char* field) {
  if (!id.empty() && ValidSessionId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": 1 to ", kMaxSessionIdLength, " characters of [A-Za-z0-9._:-]"));
}

absl::StatusOr<OpenParams> DecodeOpenSession(const v1::OpenSessionRequest& request,
                                             VersionPtr version, const RequestLimits& limits) {
  if (!ValidSessionId(request.session_id())) {
    return absl::InvalidArgumentError(absl::StrCat("session_id: at most ", kMaxSessionIdLength,
                                                   " characters of [A-Za-z0-9._:-]"));
  }
  if (request.idle_timeout_ms() < 0 || request.max_tokens() < 0) {
    return absl::InvalidArgumentError("idle_timeout_ms and max_tokens: 0 (default) or positive");
  }
  OpenParams params;
  params.id = request.session_id();
  params.idle_timeout = absl::Milliseconds(request.idle_timeout_ms());
  params.max_tokens = request.max_tokens();
  if (!request.has_memory()) {
    if (request.has_memory_value() || request.has_memory_key_padding_mask()) {
      return absl::InvalidArgumentError(
          "memory_value and memory_key_padding_mask need a memory (a cross-attention session)");
    }
    params.version = std::move(version);
    return params;
  }
  RequestInputs in;
  ASSIGN_OR_RETURN(in.key, ViewTensor(request.memory(), "memory"));
  if (request.has_memory_value()) {
    ASSIGN_OR_RETURN(in.value, ViewTensor(request.memory_value(), "memory_value"));
  }
  if (request.has_memory_key_padding_mask()) {
    ASSIGN_OR_RETURN(in.key_padding_mask,
                     ViewTensor(request.memory_key_padding_mask(), "memory_key_padding_mask"));
  }
  absl::StatusOr<AttentionRequest> memory =
      MemoryRequest(version->loaded.dims, in, limits, DTypeSpelling::kMhaV1);
  if (!memory.ok()) return RenameMemoryFields(memory.status());
  params.memory.emplace(*std::move(memory));
  params.version = std::move(version);
  return params;
}

absl::StatusOr<AttentionRequest> MemoryRequest(const AttentionDims& dims, RequestInputs memory,
                                               const RequestLimits& limits,
                                               DTypeSpelling spelling) {
  if (!memory.key.has_value()) return absl::InvalidArgumentError("key: required");
  if (memory.key->shape.size() == 3 && memory.key->shape[0] != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: one sequence per session, [1, S, kdim] or [S, kdim]; got [",
                     absl::StrJoin(memory.key->shape, ", "), "]"));
  }
  // A one-token zero query of the memory's rank: AttentionRequest then
  // checks the memory as it checks an Attend's key.
  auto dummy = std::make_shared<std::vector<float>>(static_cast<size_t>(dims.embed_dim), 0.0f);
  memory.query.dtype = DType::kF32;
  memory.query.shape = memory.key->shape.size() == 3 ? std::vector<int64_t>{1, 1, dims.embed_dim}
                                                     : std::vector<int64_t>{1, dims.embed_dim};
  memory.query.bytes = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(dummy->data()),
                                           dummy->size() * sizeof(float));
  ASSIGN_OR_RETURN(AttentionRequest request,
                   AttentionRequest::Create(dims, memory, limits.max_tokens, spelling));
  request.KeepAlive(dummy);
  return request;
}

absl::StatusOr<AttentionRequest> StepQuery(const AttentionDims& dims, const TensorView& query,
                                           bool need_weights, const RequestLimits& limits,
                                           DTypeSpelling spelling) {
  if (query.shape.size() == 3 && query.shape[0] != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("query: one sequence per step, [1, T, E] or [T, E]; got [",
                     absl::StrJoin(query.shape, ", "), "]"));
  }
  RequestInputs in;
  in.query = query;
  in.need_weights = need_weights;
  // Checked as a self-attention query: a cross session's keys are its
  // memory's, whatever kdim and vdim.
  AttentionDims query_dims = dims;
  query_dims.kdim = query_dims.vdim = dims.embed_dim;
  ASSIGN_OR_RETURN(AttentionRequest checked,
                   AttentionRequest::Create(query_dims, in, limits.max_tokens, spelling));
  if (checked.q_len() < 1) return absl::InvalidArgumentError("query: needs at least one token");
  return checked;
}

absl::StatusOr<StepParams> DecodeAppend(const v1::AppendRequest& request, const AttentionDims& dims,
                                        const RequestLimits& limits,
                                        const ReceivedBytes* query_data) {
  if (!request.has_query()) return absl::InvalidArgumentError("query: required");
  ASSIGN_OR_RETURN(TensorView view, ViewTensor(request.query(), "query", query_data));
  ASSIGN_OR_RETURN(AttentionRequest query,
                   StepQuery(dims, view, request.need_weights(), limits, DTypeSpelling::kMhaV1));
  StepParams params{request.session_id(), std::move(query), std::nullopt,
                    /*decoded_for=*/nullptr};  // the caller knows the version
  if (request.has_expected_position()) params.expected_position = request.expected_position();
  return params;
}

void EncodeSession(const SessionInfo& info, v1::Session* out) {
  out->set_session_id(info.id);
  out->set_position(info.position);
  out->set_expires_at(absl::ToUnixMillis(info.expires_at));
  out->set_reserved_bytes(info.bytes);
  out->set_model(info.model);
  out->set_model_version(info.version);
  out->set_cross(info.cross);
  out->set_max_tokens(info.max_tokens);
}

StepLayout StepLayout::Of(const StepParams& params) {
  return StepLayout{params.query.output_shape(), params.query.output_dtype(),
                    params.query.need_weights()};
}

void EncodeAppendResult(const StepLayout& layout, const StepResult& result,
                        v1::AppendResponse* out) {
  EncodeTensor(result.output, layout.output_shape, layout.output_dtype, out->mutable_output());
  out->set_position(result.position);
  if (layout.need_weights) {
    EncodeTensor(result.weights, StepWeightsShape(layout, result.keys), DType::kF32,
                 out->mutable_attn_weights());
  }
}

std::vector<int64_t> StepWeightsShape(const StepLayout& layout, int64_t keys) {
  const int64_t tokens = layout.output_shape[layout.output_shape.size() - 2];
  std::vector<int64_t> shape = {tokens, keys};
  if (layout.output_shape.size() == 3) shape.insert(shape.begin(), 1);
  return shape;
}

}  // namespace mha::server
