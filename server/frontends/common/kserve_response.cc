// The KServe v2 answers: a ModelInferResponse from an Attend result or a
// session step's (outputs inline or written to their shared-memory slices),
// and a model's metadata.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "server/frontends/common/kserve_codec.h"

namespace mha::server {

absl::Status FillInferResponse(const inference::ModelInferRequest& request, int64_t version,
                               const std::vector<RequestedOutput>& outputs,
                               const ResultLayout& layout, const AttentionResult& result,
                               inference::ModelInferResponse* response,
                               std::vector<DeferredOutput>* deferred) {
  response->set_model_name(request.model_name());
  response->set_model_version(absl::StrCat(version));
  response->set_id(request.id());
  for (const RequestedOutput& requested : outputs) {
    const bool is_output = requested.name == kOutputName;
    const DType dtype = is_output ? layout.output_dtype : DType::kF32;
    const std::vector<int64_t>& shape = is_output ? layout.output_shape : layout.weights_shape;
    inference::ModelInferResponse::InferOutputTensor* tensor = response->add_outputs();
    tensor->set_name(requested.name);
    tensor->set_datatype(DTypeName(dtype, DTypeSpelling::kKserve));
    tensor->mutable_shape()->Assign(shape.begin(), shape.end());
    std::string* raw = response->add_raw_output_contents();
    const absl::Span<const float> values = is_output ? result.output : result.weights;
    if (!requested.shared_memory.has_value()) {
      if (deferred != nullptr) {
        deferred->push_back({response->raw_output_contents_size() - 1, values, dtype, result.owner,
                             is_output ? result.converted : ConvertedOutput{}});
      } else {
        EncodeBytes(values, dtype, *raw);
      }
      continue;
    }
    const SharedMemorySlice& slice = *requested.shared_memory;
    if (values.size() * DTypeSize(dtype) > slice.byte_size) {
      return absl::InvalidArgumentError(absl::StrCat("output ", requested.name, ": ", kShmByteSize,
                                                     " ", slice.byte_size, " cannot hold its ",
                                                     values.size() * DTypeSize(dtype), " bytes"));
    }
    if (dtype == DType::kF32) {  // straight from the engine's output
      RETURN_IF_ERROR(slice.Write(AsBytes(values.data(), values.size() * sizeof(float))));
    } else if (is_output && IsConvertedFrom(result.converted, values, dtype)) {
      RETURN_IF_ERROR(slice.Write(result.converted.bytes));
    } else {
      std::string converted;
      EncodeBytes(values, dtype, converted);
      RETURN_IF_ERROR(slice.Write(AsBytes(converted.data(), converted.size())));
    }
  }
  return absl::OkStatus();
}

absl::Status FillSequenceResponse(const inference::ModelInferRequest& request, int64_t version,
                                  const std::vector<RequestedOutput>& outputs,
                                  const StepLayout& layout, const StepResult& result,
                                  inference::ModelInferResponse* response) {
  const int64_t tokens = layout.output_shape[layout.output_shape.size() - 2];
  std::vector<int64_t> weights_shape = {tokens, result.keys};
  if (layout.output_shape.size() == 3) weights_shape.insert(weights_shape.begin(), 1);
  ResultLayout as_attend{layout.output_dtype, layout.output_shape, std::move(weights_shape)};
  return FillInferResponse(request, version, outputs, as_attend,
                           AttentionResult{result.output, result.weights, nullptr, {}}, response);
}

void DescribeModel(const std::string& name, const AttentionDims& dims,
                   const std::vector<int64_t>& versions,
                   inference::ModelMetadataResponse* response) {
  response->set_name(name);
  for (const int64_t v : versions) response->add_versions(absl::StrCat(v));
  response->set_platform("mha_onednn");
  const char* fp32 = DTypeName(DType::kF32, DTypeSpelling::kKserve);
  const char* boolean = DTypeName(DType::kBool, DTypeSpelling::kKserve);
  auto add = [](auto* list, const char* tensor, const char* datatype, std::vector<int64_t> shape) {
    auto* meta = list->Add();
    meta->set_name(tensor);
    meta->set_datatype(datatype);
    meta->mutable_shape()->Assign(shape.begin(), shape.end());
  };
  add(response->mutable_inputs(), "query", fp32, {-1, -1, dims.embed_dim});
  add(response->mutable_inputs(), "key", fp32, {-1, -1, dims.kdim});
  add(response->mutable_inputs(), "value", fp32, {-1, -1, dims.vdim});
  add(response->mutable_inputs(), "key_padding_mask", boolean, {-1, -1});
  add(response->mutable_inputs(), "attn_mask", boolean, {-1, -1});
  add(response->mutable_outputs(), kOutputName, fp32, {-1, -1, dims.embed_dim});
  add(response->mutable_outputs(), kWeightsName, fp32, {-1, -1, -1});
}

}  // namespace mha::server
