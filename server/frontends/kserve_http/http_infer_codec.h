// Triton's HTTP inference body, JSON with its binary tensor data
// extension, to KServe's ModelInferRequest and back. Pure conversion: what
// the request means is checked where gRPC's is (kserve_codec.h), so the two
// transports refuse the same things with the same words.
#ifndef MHA_SERVER_FRONTENDS_HTTP_INFER_CODEC_H_
#define MHA_SERVER_FRONTENDS_HTTP_INFER_CODEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "server/frontends/common/kserve_codec.h"
#include "server/frontends/kserve_http/http_bytes.h"

namespace mha::server {

// Deepest nesting a request's JSON may have (a tensor of rank 8 in nested
// arrays fits well within it).
inline constexpr int kMaxJsonDepth = 32;

// Parses `text` as JSON no deeper than kMaxJsonDepth; INVALID_ARGUMENT
// naming `what` and the reason otherwise.
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, absl::string_view what);

// A decoded HTTP infer request: the KServe message (every input not in
// shared memory as raw little-endian bytes, in input order; the HTTP-only
// parameters taken out) and how each output goes back.
struct HttpInferRequest {
  inference::ModelInferRequest message;
  // Per raw entry of `message`: its bytes in the body (binary data: the
  // entry stays empty, the body is held once), or empty (the entry holds
  // the bytes, decoded from JSON). The body must outlive these.
  std::vector<std::vector<absl::Span<const uint8_t>>> in_body;
  bool binary_by_default = false;  // `binary_data_output`
  // Outputs asked for with their `binary_data` parameter (unset: default).
  std::vector<std::pair<std::string, std::optional<bool>>> outputs;

  bool Binary(const std::string& output_name) const;
  // Copies the inputs left in the body into `message` (for a path that reads
  // the message itself: a sequence's step, a few tokens).
  void Materialize();
};

// `body` with `header_length` (the Inference-Header-Content-Length value;
// absent: the whole body is JSON) for `model`/`version` (from the path).
// Header length 0 is Triton's raw form: the body is the one input's bytes,
// here an FP32 query [1, L, E] with `raw_query_width` = E (the model's, from
// its metadata), and every output goes back binary. Errors are
// INVALID_ARGUMENT, naming the input and what is wrong.
absl::StatusOr<HttpInferRequest> DecodeHttpInfer(absl::string_view body,
                                                 std::optional<size_t> header_length,
                                                 const std::string& model,
                                                 const std::string& version,
                                                 int64_t raw_query_width = 0);

// The response body: JSON, followed by the binary outputs' bytes when any
// output goes as binary (then `header_length` is the JSON's size). The
// binary outputs are moved out of `response` into `binary`, in order, to
// be sent after `body` as they are (no joined copy). An output listed in
// `views` (F32, or converted by the worker; its raw entry left empty:
// FillInferResponse's deferred outputs) is read from its values, or its
// converted bytes, instead, and sent from them as binary.
struct HttpInferBody {
  std::string body;
  std::vector<HttpBytes> binary;
  std::optional<size_t> header_length;
};
absl::StatusOr<HttpInferBody> EncodeHttpInfer(inference::ModelInferResponse& response,
                                              const HttpInferRequest& request,
                                              absl::Span<const DeferredOutput> views = {});

// A protobuf message as JSON with every field (defaults too), 64-bit
// integers as numbers, maps as objects: the shape Triton's HTTP API gives
// for metadata, statistics and the repository.
nlohmann::json MessageToJson(const google::protobuf::Message& message);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_HTTP_INFER_CODEC_H_
