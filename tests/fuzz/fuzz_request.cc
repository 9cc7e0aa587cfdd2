// libFuzzer target: an AttendRequest decoded from fuzz bytes goes through
// the server's checks and, when valid, through the engine of a small
// cross-attention model and a small self-attention model. Built a second
// time as fuzz_kserve (MHA_FUZZ_KSERVE): the bytes are a KServe v2
// ModelInferRequest, decoded as ModelInfer decodes it. Built a third time as
// fuzz_http (MHA_FUZZ_HTTP): the bytes are an HTTP infer request's headers
// ("Name: value" lines), an empty line and its body, decoded as the HTTP
// front end decodes them (Content-Encoding, Triton's JSON and binary body)
// and then as ModelInfer.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "google/protobuf/stubs/logging.h"
#include "server/frontends/common/kserve_codec.h"
#include "server/frontends/common/request_codec.h"
#include "server/frontends/kserve_http/http_infer_codec.h"
#include "server/frontends/kserve_http/http_server.h"
#include "server/scheduling/admission.h"
#include "tests/engine/test_models.h"

namespace {

struct Model {
  mha::AttentionDims dims;
  std::unique_ptr<mha::MhaEngine> engine;
  std::unique_ptr<mha::Workspace> ws;
};

Model MakeModel(int64_t kdim, bool extras) {
  Model m;
  m.dims.embed_dim = 8, m.dims.num_heads = 2, m.dims.kdim = kdim, m.dims.vdim = kdim;
  m.dims.qk_head_dim = m.dims.v_head_dim = 4;
  m.dims.add_bias_kv = m.dims.add_zero_attn = extras;
  m.engine = mha::MhaEngine::Create(m.dims, mha::testing::RandomWeights(m.dims, 1)).value();
  m.ws = m.engine->NewWorkspace();
  return m;
}

constexpr mha::server::RequestLimits kLimits{.max_tokens = 4096};

void RunOn(Model& m, const absl::StatusOr<mha::AttentionRequest>& d) {
  if (!d.ok()) return;
  const mha::AttentionBatch& batch = d->batch();
  std::vector<float> output(d->output_elements());
  std::vector<float> weights(d->weights_elements());
  if (d->need_weights() && static_cast<int64_t>(weights.size()) !=
                               m.engine->WeightsElements(batch, d->per_head_weights())) {
    __builtin_trap();
  }
  // Admission's cost, from the shapes alone, must bound what the call
  // really takes: the response's bytes, and a fresh workspace's.
  const mha::server::RequestCost cost = mha::server::CostOf(*d, *m.engine, mha::AvailableCores());
  if (cost.response_bytes < static_cast<int64_t>((output.size() + weights.size()) * 2)) {
    __builtin_trap();
  }
  m.ws->ReleaseIfAbove(0);
  const absl::Status s = m.engine->Run(
      batch, {absl::MakeSpan(output), absl::MakeSpan(weights), d->per_head_weights()}, *m.ws);
  // A request the codec accepted must compute.
  if (!s.ok()) __builtin_trap();
  if (static_cast<int64_t>(m.ws->bytes_held()) > cost.active_bytes) __builtin_trap();
}

}  // namespace

// Protobuf logs every string field with invalid UTF-8; fuzz inputs are full
// of them.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

#ifdef MHA_FUZZ_HTTP
// The HTTP body's ModelInferRequest, or false when the front end refuses
// it (every refusal must be INVALID_ARGUMENT or, for the decompressed size,
// RESOURCE_EXHAUSTED).
bool DecodeHttp(const uint8_t* data, size_t size, inference::ModelInferRequest& infer,
                mha::server::HttpInferRequest& decoded) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t split = text.find("\n\n");
  if (split == std::string::npos) return false;
  std::string encoding;
  std::optional<size_t> header_length;
  for (absl::string_view line : absl::StrSplit(text.substr(0, split), '\n')) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    const std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    size_t n = 0;
    if (name == "content-encoding") encoding = std::string(value);
    if (name == "inference-header-content-length" && absl::SimpleAtoi(value, &n)) header_length = n;
  }
  absl::StatusOr<std::string> body =
      mha::server::DecodeContent(encoding, text.substr(split + 2), 1 << 20);
  if (!body.ok()) {
    if (!absl::IsInvalidArgument(body.status()) && !absl::IsResourceExhausted(body.status())) {
      __builtin_trap();
    }
    return false;
  }
  absl::StatusOr<mha::server::HttpInferRequest> request =
      mha::server::DecodeHttpInfer(*body, header_length, "m", "");
  if (!request.ok()) {
    if (!absl::IsInvalidArgument(request.status()) || request.status().message().empty()) {
      __builtin_trap();
    }
    return false;
  }
  request->Materialize();  // the body ends here: its inputs into the message
  decoded = *std::move(request);
  infer = decoded.message;
  return true;
}
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Model self = MakeModel(8, false);
  static Model cross = MakeModel(6, true);
#if defined(MHA_FUZZ_KSERVE) || defined(MHA_FUZZ_HTTP)
  inference::ModelInferRequest infer;
#ifdef MHA_FUZZ_HTTP
  mha::server::HttpInferRequest http;
  if (!DecodeHttp(data, size, infer, http)) return 0;
  // What a response to it would be encoded as: any outputs, either way.
  inference::ModelInferResponse response;
  for (int i = 0; i < infer.inputs_size(); ++i) {
    auto* out = response.add_outputs();
    out->set_name(infer.inputs(i).name());
    out->set_datatype(infer.inputs(i).datatype());
    *out->mutable_shape() = infer.inputs(i).shape();
    if (i < infer.raw_input_contents_size()) {
      response.add_raw_output_contents(infer.raw_input_contents(i));
    }
  }
  (void)mha::server::EncodeHttpInfer(response, http);
#else
  if (!infer.ParseFromArray(data, static_cast<int>(size))) return 0;
#endif
  std::vector<mha::server::RequestedOutput> outputs;
  for (Model* m : {&self, &cross}) {
    RunOn(*m, mha::server::DecodeInferRequest(infer, m->dims, kLimits, nullptr, outputs));
    // A sequence request's decoding: one sequence, a memory only at a start.
    for (const bool start : {false, true}) {
      absl::StatusOr<mha::server::SequenceInputs> step =
          mha::server::DecodeSequenceRequest(infer, m->dims, kLimits, nullptr, start, outputs);
      if (!step.ok()) continue;
      if (step->query.rows() != 1 || step->query.q_len() < 1) __builtin_trap();
      if (step->memory.has_value() && !start) __builtin_trap();
    }
  }
  (void)mha::server::ReadCallParameters(infer);
#else
  mha::v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  for (Model* m : {&self, &cross}) {
    RunOn(*m, mha::server::DecodeAttendRequest(request, m->dims, kLimits));
  }
#endif
  return 0;
}
