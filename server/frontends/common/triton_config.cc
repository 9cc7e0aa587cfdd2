#include "server/frontends/common/triton_config.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/weights.h"
#include "server/sessions/session_manager.h"

namespace mha::server {
namespace {

void AddInput(inference::ModelConfig* out, const char* name, inference::DataType type,
              std::vector<int64_t> dims, bool optional) {
  inference::ModelInput* input = out->add_input();
  input->set_name(name);
  input->set_data_type(type);
  input->mutable_dims()->Assign(dims.begin(), dims.end());
  input->set_allow_ragged_batch(true);  // requests of any lengths share engine calls
  input->set_optional(optional);
}

void AddOutput(inference::ModelConfig* out, const char* name, std::vector<int64_t> dims) {
  inference::ModelOutput* output = out->add_output();
  output->set_name(name);
  output->set_data_type(inference::TYPE_FP32);
  output->mutable_dims()->Assign(dims.begin(), dims.end());
}

void SetVersionPolicy(const v1::VersionPolicy& ours, inference::ModelVersionPolicy* out) {
  switch (ours.policy_choice_case()) {
    case v1::VersionPolicy::kAll:
      out->mutable_all();
      return;
    case v1::VersionPolicy::kSpecific:
      out->mutable_specific()->mutable_versions()->Assign(ours.specific().versions().begin(),
                                                          ours.specific().versions().end());
      return;
    case v1::VersionPolicy::kLatest:
      out->mutable_latest()->set_num_versions(
          static_cast<uint32_t>(std::max<int64_t>(1, ours.latest().num_versions())));
      return;
    default:  // Triton's default too
      out->mutable_latest()->set_num_versions(1);
  }
}

void SetParameters(const ModelVersion& version, inference::ModelConfig* out) {
  const AttentionDims& d = version.loaded.dims;
  const v1::ModelConfig& config = version.loaded.config;
  auto set = [out](const char* name, const auto& value) {
    (*out->mutable_parameters())[name].set_string_value(absl::StrCat(value));
  };
  auto flag = [](bool b) { return b ? "true" : "false"; };
  set("embed_dim", d.embed_dim);
  set("num_heads", d.num_heads);
  set("kdim", d.kdim);
  set("vdim", d.vdim);
  set("qk_head_dim", d.qk_head_dim);
  set("v_head_dim", d.v_head_dim);
  set("bias", flag(d.bias));
  set("add_bias_kv", flag(d.add_bias_kv));
  set("add_zero_attn", flag(d.add_zero_attn));
  set("post_norm", flag(d.post_norm));
  // What it computes in on this CPU (INT8: the projections; the core's type
  // is kv_cache_dtype's unless that was asked for apart).
  set("compute_dtype", d.int8 ? "INT8" : d.bf16 ? "BF16" : "FP32");
  set("kv_cache_dtype", CacheDtypeName(version.loaded.engine->kv_layout()));
  set("weight_layout", WeightLayoutName(version.loaded.layout));
  set("parameter_count", version.loaded.parameter_count);
  set("max_batch_tokens", config.dynamic_batching().max_batch_tokens());
  set("max_queue_size", config.dynamic_batching().max_queue_size());
}

}  // namespace

void DescribeTritonConfig(const ModelVersion& version, int64_t max_request_tokens,
                          inference::ModelConfig* out) {
  const AttentionDims& d = version.loaded.dims;
  const v1::ModelConfig& config = version.loaded.config;
  out->set_name(version.name);
  out->set_platform("mha_onednn");
  out->set_backend("mha_onednn");
  SetVersionPolicy(config.version_policy(), out->mutable_version_policy());
  // Every sequence has at least one token: a request holds at most this many.
  out->set_max_batch_size(static_cast<int32_t>(
      std::min<int64_t>(max_request_tokens, std::numeric_limits<int32_t>::max())));
  AddInput(out, "query", inference::TYPE_FP32, {-1, d.embed_dim}, false);
  AddInput(out, "key", inference::TYPE_FP32, {-1, d.kdim}, true);
  AddInput(out, "value", inference::TYPE_FP32, {-1, d.vdim}, true);
  AddInput(out, "key_padding_mask", inference::TYPE_BOOL, {-1}, true);
  AddInput(out, "attn_mask", inference::TYPE_BOOL, {-1}, true);
  AddOutput(out, "output", {-1, d.embed_dim});
  AddOutput(out, "attn_weights", {-1, -1});
  inference::ModelInstanceGroup* group = out->add_instance_group();
  group->set_name(version.name);
  group->set_kind(inference::ModelInstanceGroup::KIND_CPU);
  group->set_count(1);
  const v1::DynamicBatching& batching = config.dynamic_batching();
  if (!batching.has_enabled() || batching.enabled()) {
    inference::ModelDynamicBatching* dynamic = out->mutable_dynamic_batching();
    dynamic->set_max_queue_delay_microseconds(
        static_cast<uint64_t>(std::max<int64_t>(0, batching.max_queue_delay_us())));
    dynamic->set_priority_levels(batching.priority_levels());
    if (batching.priority_levels() > 0) {
      dynamic->set_default_priority_level(batching.default_priority_level() > 0
                                              ? batching.default_priority_level()
                                              : batching.priority_levels());
    }
  }
  SetParameters(version, out);
}

}  // namespace mha::server
