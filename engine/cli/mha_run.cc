// mha_run: runs one model folder on tensors from a safetensors file and
// writes the results to another. The offline door to the engine.
#include <cstdio>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/dense_batch.h"
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

absl::StatusOr<DenseInputs> TakeInputs(TensorMap tensors, bool is_causal) {
  DenseInputs in;
  auto take = [&](const char* name) -> std::optional<Tensor> {
    auto it = tensors.find(name);
    if (it == tensors.end()) return std::nullopt;
    Tensor t = std::move(it->second);
    tensors.erase(it);
    return t;
  };
  std::optional<Tensor> query = take("query");
  if (!query.has_value()) return absl::InvalidArgumentError("inputs: missing tensor 'query'");
  in.query = std::move(*query);
  in.key = take("key");
  in.value = take("value");
  in.key_padding_mask = take("key_padding_mask");
  in.attn_mask = take("attn_mask");
  in.is_causal = is_causal;
  if (!tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: unknown tensor '", tensors.begin()->first, "'"));
  }
  return in;
}

absl::Status RunOnce() {
  ASSIGN_OR_RETURN(LoadedModel model, LoadModel(absl::GetFlag(FLAGS_model)));
  ASSIGN_OR_RETURN(TensorMap tensors, ReadSafetensors(absl::GetFlag(FLAGS_inputs)));
  ASSIGN_OR_RETURN(DenseInputs inputs,
                   TakeInputs(std::move(tensors), absl::GetFlag(FLAGS_is_causal)));
  ASSIGN_OR_RETURN(DenseBatch dense, DenseBatch::Create(model.dims, std::move(inputs)));

  const bool need_weights = absl::GetFlag(FLAGS_need_weights);
  const bool per_head = absl::GetFlag(FLAGS_per_head_weights);
  TensorMap results;
  Tensor& output = results["output"] = Tensor(DType::kF32, dense.OutputShape());
  AttentionOutputs out;
  out.output = absl::Span<float>(output.f32(), output.num_elements());
  out.per_head_weights = per_head;
  if (need_weights) {
    Tensor& weights = results["attn_weights"] =
        Tensor(DType::kF32, dense.WeightsShape(per_head));
    out.weights = absl::Span<float>(weights.f32(), weights.num_elements());
  }
  std::unique_ptr<Workspace> ws = model.engine->NewWorkspace();
  RETURN_IF_ERROR(model.engine->Run(dense.batch(), out, *ws));
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
