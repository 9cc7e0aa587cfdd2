// libFuzzer target: an AttendRequest decoded from fuzz bytes goes through
// the server's checks and, when valid, through the engine of a small
// cross-attention model and a small self-attention model. Built a second
// time as fuzz_kserve (MHA_FUZZ_KSERVE): the bytes are a KServe v2
// ModelInferRequest, decoded as ModelInfer decodes it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/mha_engine.h"
#include "engine/threads.h"
#include "google/protobuf/stubs/logging.h"
#include "server/frontends/kserve_codec.h"
#include "server/frontends/request_codec.h"
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

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Model self = MakeModel(8, false);
  static Model cross = MakeModel(6, true);
#ifdef MHA_FUZZ_KSERVE
  inference::ModelInferRequest infer;
  if (!infer.ParseFromArray(data, static_cast<int>(size))) return 0;
  std::vector<mha::server::RequestedOutput> outputs;
  for (Model* m : {&self, &cross}) {
    RunOn(*m, mha::server::DecodeInferRequest(infer, m->dims, kLimits, nullptr, outputs));
    // A sequence request's decoding: one sequence, a memory only at a start.
    for (const bool start : {false, true}) {
      absl::StatusOr<mha::server::SequenceInputs> step =
          mha::server::DecodeSequenceRequest(infer, m->dims, kLimits, nullptr, start, outputs);
      if (!step.ok()) continue;
      if (step->query.sequences() != 1 || step->query.q_len() < 1) __builtin_trap();
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
