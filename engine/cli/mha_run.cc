// mha_run: runs one model folder on tensors from a safetensors file and
// writes the results to another. The offline door to the engine.
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/attention_request.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/status_macros.h"

ABSL_FLAG(std::string, model, "", "model folder (config.pbtxt + weights.safetensors)");
ABSL_FLAG(std::string, inputs, "",
          "safetensors with query [, key, value, key_padding_mask, attn_mask]");
ABSL_FLAG(std::string, outputs, "", "safetensors to write: output [, attn_weights]");
ABSL_FLAG(bool, is_causal, false, "query i may not attend key j > i");
ABSL_FLAG(bool, need_weights, false, "also write attn_weights");
ABSL_FLAG(bool, per_head_weights, false, "attn_weights per head instead of averaged");

namespace mha {
namespace {

// The tensors of the inputs file by name, and views of them for the request.
absl::StatusOr<RequestInputs> TakeInputs(const TensorMap& tensors) {
  for (const auto& [name, tensor] : tensors) {
    if (name != "query" && name != "key" && name != "value" && name != "key_padding_mask" &&
        name != "attn_mask") {
      return absl::InvalidArgumentError(absl::StrCat("inputs: unknown tensor '", name, "'"));
    }
  }
  auto view = [&](const char* name) -> std::optional<TensorView> {
    auto it = tensors.find(name);
    if (it == tensors.end()) return std::nullopt;
    return ViewOf(it->second);
  };
  RequestInputs in;
  std::optional<TensorView> query = view("query");
  if (!query.has_value()) return absl::InvalidArgumentError("inputs: missing tensor 'query'");
  in.query = *std::move(query);
  in.key = view("key");
  in.value = view("value");
  in.key_padding_mask = view("key_padding_mask");
  in.attn_mask = view("attn_mask");
  in.is_causal = absl::GetFlag(FLAGS_is_causal);
  in.need_weights = absl::GetFlag(FLAGS_need_weights);
  in.per_head_weights = absl::GetFlag(FLAGS_per_head_weights);
  return in;
}

absl::Status RunOnce() {
  ASSIGN_OR_RETURN(LoadedModel model, LoadModel(absl::GetFlag(FLAGS_model)));
  ASSIGN_OR_RETURN(TensorMap tensors, ReadSafetensors(absl::GetFlag(FLAGS_inputs)));
  ASSIGN_OR_RETURN(RequestInputs inputs, TakeInputs(tensors));
  ASSIGN_OR_RETURN(AttentionRequest request,
                   AttentionRequest::Create(model.dims, inputs, std::numeric_limits<int64_t>::max(),
                                            DTypeSpelling::kSafetensors));
  // Results in f32, whatever the inputs' dtype.
  TensorMap results;
  Tensor& output = results["output"] = Tensor(DType::kF32, request.output_shape());
  AttentionOutputs out;
  out.output = absl::Span<float>(output.f32(), output.num_elements());
  out.per_head_weights = request.per_head_weights();
  if (request.need_weights()) {
    Tensor& weights = results["attn_weights"] = Tensor(DType::kF32, request.weights_shape());
    out.weights = absl::Span<float>(weights.f32(), weights.num_elements());
  }
  std::unique_ptr<Workspace> ws = model.engine->NewWorkspace();
  RETURN_IF_ERROR(model.engine->Run(request.batch(), out, *ws));
  if (FirstNonFinite(out.output) >= 0) {
    return absl::InvalidArgumentError(
        "inputs too large or not finite: the output has NaN or infinite values");
  }
  return WriteSafetensors(absl::GetFlag(FLAGS_outputs), results);
}

}  // namespace
}  // namespace mha

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mha_run --model DIR --inputs in.safetensors --outputs out.safetensors "
      "[--is_causal] [--need_weights] [--per_head_weights]");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_model).empty() || absl::GetFlag(FLAGS_inputs).empty() ||
      absl::GetFlag(FLAGS_outputs).empty()) {
    std::fprintf(stderr, "usage: %s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const absl::Status status = mha::RunOnce();
  if (!status.ok()) {
    std::fprintf(stderr, "mha_run: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
