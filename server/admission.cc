#include "server/admission.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/memory_budget.h"

namespace mha::server {
namespace {

// Protobuf framing of a response beyond its tensor bytes (tags, lengths,
// shapes, names): generously bounded.
constexpr int64_t kResponseFraming = 4096;

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t WireSize(v1::DataType dtype) {
  return dtype == v1::DATA_TYPE_BF16 || dtype == v1::DATA_TYPE_FP16 ? 2 : 4;
}

const char* WireName(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16: return "BF16";
    case v1::DATA_TYPE_FP16: return "FP16";
    default: return "FP32";
  }
}

int64_t MaskBytes(const MaskView& mask) {
  return mask.present() ? mask.num_elements * (mask.dtype == DType::kBool ? 1 : 4) : 0;
}

BatchShape ShapeOf(const DecodedRequest& r) {
  const AttentionBatch& b = r.batch.batch();
  BatchShape shape;
  shape.sequences = b.num_sequences();
  if (shape.sequences == 0) return shape;
  shape.q_len = b.q_offsets[1] - b.q_offsets[0];
  shape.self_attention = b.self_attention();
  shape.kv_len = shape.self_attention ? shape.q_len : b.kv_offsets[1] - b.kv_offsets[0];
  shape.value_is_key = b.value.empty();
  for (const MaskView* m : {&b.key_padding_mask, &b.attn_mask}) {
    if (m->present() && m->dtype == DType::kBool) shape.bool_mask_elements += m->num_elements;
  }
  shape.need_weights = r.need_weights;
  return shape;
}

}  // namespace

RequestCost CostOf(const DecodedRequest& request, const MhaEngine& engine, int threads) {
  const AttentionBatch& b = request.batch.batch();
  const int64_t inputs_f32 =
      static_cast<int64_t>(b.query.size() + b.key.size() + b.value.size()) * 4;
  const int64_t masks = MaskBytes(b.key_padding_mask) + MaskBytes(b.attn_mask);
  const int64_t masks_f32 = (b.key_padding_mask.num_elements + b.attn_mask.num_elements) * 4;
  const int64_t results_f32 =
      (Elements(request.output_shape) +
       (request.weights_shape.empty() ? 0 : Elements(request.weights_shape))) * 4;
  RequestCost cost;
  cost.response_bytes = Elements(request.output_shape) * WireSize(request.output_dtype) +
                        (request.weights_shape.empty() ? 0 : Elements(request.weights_shape) * 4) +
                        kResponseFraming;
  cost.queued_bytes = request.bytes + inputs_f32 + masks;
  // A batch of several requests copies their inputs into one (masks made
  // f32) and cuts each one's results out of the batch's: counted always,
  // since the batch a request lands in is not known yet.
  cost.active_bytes = engine.ScratchBytes(ShapeOf(request), threads) + inputs_f32 + masks_f32 +
                      2 * results_f32 + 2 * cost.response_bytes;
  return cost;
}

absl::Status CheckResponseSize(const DecodedRequest& request, const RequestCost& cost,
                               int64_t max_message_bytes) {
  if (cost.response_bytes > max_message_bytes) {
    const std::string limit =
        absl::StrCat("the limit is ", WithCommas(max_message_bytes), " (--max_message_bytes)");
    const int64_t weights =
        request.weights_shape.empty() ? 0 : Elements(request.weights_shape) * 4;
    if (weights > max_message_bytes / 2) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "attn_weights would be ", WithCommas(weights), " bytes (",
          ShapeString(request.weights_shape), " FP32); ", limit, ": ask without need_weights",
          request.per_head_weights ? ", without per_head_weights" : "",
          " or for fewer query rows"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would be ", WithCommas(cost.response_bytes), " bytes (output ",
        ShapeString(request.output_shape), " ", WireName(request.output_dtype),
        weights > 0 ? absl::StrCat(" + attn_weights ", ShapeString(request.weights_shape),
                                   " FP32")
                    : "",
        "); ", limit, ": send fewer query rows per request"));
  }
  return absl::OkStatus();
}

absl::Status CheckWorkingMemory(const DecodedRequest& request, const RequestCost& cost,
                                int64_t memory_capacity) {
  if (cost.total() > memory_capacity) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", WithCommas(cost.total()), " bytes of working memory (",
        WithCommas(cost.queued_bytes), " for its inputs, ", WithCommas(cost.active_bytes),
        " to compute and answer); the server's memory budget for requests is ",
        WithCommas(memory_capacity),
        " (--memory_limit_bytes less the engines' reserve): send fewer or shorter sequences",
        request.need_weights ? " or ask without need_weights" : ""));
  }
  return absl::OkStatus();
}

}  // namespace mha::server
