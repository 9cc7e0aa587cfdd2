#include "engine/model_config.h"

#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/file_read.h"
#include "engine/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace mha {
namespace {

// Keeps the first parse error with its position.
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (error_.empty()) {
      error_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
    }
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

// A dtype field holding a type the server does not take for it.
absl::Status NotOneOf(const char* field, v1::DataType got) {
  return absl::InvalidArgumentError(absl::StrCat(
      "config: ", field, " must be DATA_TYPE_FP32, DATA_TYPE_BF16 or DATA_TYPE_INT8, got ",
      v1::DataType_Name(got)));
}

// compute_dtype into `d`: FP32 (or unset), BF16, or INT8 (the projections
// in int8; the core in bf16 unless the caches are asked for in fp32, and
// where the CPU has bf16: MhaEngine::Create).
absl::Status SetComputeType(const v1::ModelConfig& config, AttentionDims& d) {
  const v1::DataType type = config.compute_dtype();
  if (type == v1::DATA_TYPE_UNSPECIFIED || type == v1::DATA_TYPE_FP32) return absl::OkStatus();
  if (type == v1::DATA_TYPE_BF16) {
    d.bf16 = true;
  } else if (type == v1::DATA_TYPE_INT8) {
    d.int8 = true;
    d.bf16 = config.kv_cache_dtype() != v1::DATA_TYPE_FP32;
  } else {
    return NotOneOf("compute_dtype", type);
  }
  return absl::OkStatus();
}

// kv_cache_dtype into `d`, once its compute type is set: unset (the compute
// type), FP32 (not beside a bf16 core), BF16 or INT8 for any model.
absl::Status SetCacheType(v1::DataType type, AttentionDims& d) {
  if (type == v1::DATA_TYPE_UNSPECIFIED) return absl::OkStatus();
  if (type == v1::DATA_TYPE_FP32) {
    if (!d.bf16) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "config: kv_cache_dtype DATA_TYPE_FP32 needs compute_dtype DATA_TYPE_FP32 (a bf16 "
        "model's cache is bf16)");
  }
  if (type == v1::DATA_TYPE_BF16) {
    d.kv_cache_bf16 = true;
  } else if (type == v1::DATA_TYPE_INT8) {
    d.kv_cache_int8 = true;
  } else {
    return NotOneOf("kv_cache_dtype", type);
  }
  return absl::OkStatus();
}

absl::Status CheckDim(const char* field, int64_t value, bool zero_allowed) {
  if (value < 0 || value > kMaxModelDim || (!zero_allowed && value == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " must be in [",
                                                   zero_allowed ? 0 : 1, ", ", kMaxModelDim,
                                                   "], got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ParseModelConfig(const std::string& text) {
  v1::ModelConfig config;
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", errors.error()));
  }
  return config;
}

absl::StatusOr<v1::ModelConfig> ReadModelConfig(const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(*text);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

absl::StatusOr<AttentionDims> ResolveDims(const v1::ModelConfig& config) {
  for (auto [field, value, zero_ok] :
       {std::tuple{"embed_dim", config.embed_dim(), false},
        std::tuple{"num_heads", config.num_heads(), false}, std::tuple{"kdim", config.kdim(), true},
        std::tuple{"vdim", config.vdim(), true},
        std::tuple{"qk_head_dim", config.qk_head_dim(), true},
        std::tuple{"v_head_dim", config.v_head_dim(), true}}) {
    if (auto s = CheckDim(field, value, zero_ok); !s.ok()) return s;
  }
  AttentionDims d;
  d.embed_dim = config.embed_dim();
  d.num_heads = config.num_heads();
  d.kdim = config.kdim() != 0 ? config.kdim() : d.embed_dim;
  d.vdim = config.vdim() != 0 ? config.vdim() : d.embed_dim;
  const bool default_head_dims = config.qk_head_dim() == 0 || config.v_head_dim() == 0;
  if (default_head_dims && d.embed_dim % d.num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: embed_dim ", d.embed_dim, " is not divisible by num_heads ",
                     d.num_heads, " (set qk_head_dim and v_head_dim to override)"));
  }
  d.qk_head_dim = config.qk_head_dim() != 0 ? config.qk_head_dim() : d.embed_dim / d.num_heads;
  d.v_head_dim = config.v_head_dim() != 0 ? config.v_head_dim() : d.embed_dim / d.num_heads;
  if (d.qk_width() > kMaxModelDim || d.v_width() > kMaxModelDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: num_heads x head_dim must be at most ", kMaxModelDim));
  }
  d.bias = !config.has_bias() || config.bias();
  d.add_bias_kv = config.add_bias_kv();
  d.add_zero_attn = config.add_zero_attn();
  RETURN_IF_ERROR(SetComputeType(config, d));
  RETURN_IF_ERROR(SetCacheType(config.kv_cache_dtype(), d));
  if (config.warmup_lengths_size() > kMaxWarmupLengths) {
    return absl::InvalidArgumentError(absl::StrCat("config: at most ", kMaxWarmupLengths,
                                                   " warmup_lengths, got ",
                                                   config.warmup_lengths_size()));
  }
  for (const int64_t len : config.warmup_lengths()) {
    if (len < 1 || len > kMaxWarmupLength) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: warmup_lengths must be in [1, ", kMaxWarmupLength, "], got ", len));
    }
  }
  d.post_norm = config.has_post_norm();
  if (d.post_norm && config.post_norm().has_eps()) {
    const double eps = config.post_norm().eps();
    if (!(eps > 0.0 && eps < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: post_norm.eps must be in (0, 1), got ", eps));
    }
    d.norm_eps = static_cast<float>(eps);
  }
  return d;
}

}  // namespace mha
