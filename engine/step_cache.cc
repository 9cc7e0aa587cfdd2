// Sessions' side of the engine: the cache layout, checking a batch of steps,
// and a cross session's memory projected into its cache (MhaEngine's
// ProjectEncoderMemory). The steps' attention itself is StepAttention's.
#include <limits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/status_macros.h"

namespace mha {

using onednn::dt;

KvLayout MhaEngine::kv_layout() const { return impl_->kv_layout(); }
bool MhaEngine::CanAppendSelf() const { return impl_->CanAppendSelf(); }

KvLayout EngineImpl::kv_layout() const {
  KvLayout layout;
  layout.heads = dims_.num_heads;
  layout.qk_head_dim = dims_.qk_head_dim;
  layout.v_head_dim = dims_.v_head_dim;
  layout.elem_bytes = dims_.kv_elem_bytes();
  return layout;
}

int64_t EngineImpl::AppendKeys(const CacheStep& step) const { return steps_->Keys(step); }

int64_t EngineImpl::StepWeightsElements(const StepBatch& batch) const {
  int64_t total = 0;
  for (const CacheStep& step : batch.steps) total += step.tokens * AppendKeys(step);
  return total;
}

int64_t MhaEngine::StepWeightsElements(const StepBatch& batch) const {
  return impl_->StepWeightsElements(batch);
}

absl::Status MhaEngine::ProjectEncoderMemory(absl::Span<const float> memory,
                                             absl::Span<const float> value, int64_t len,
                                             const MaskView& key_padding, KvCache& cache,
                                             Workspace& ws) const {
  const AttentionDims& d = impl_->dims();
  if (len < 1) return absl::InvalidArgumentError("memory: needs at least one token");
  if (static_cast<int64_t>(memory.size()) != len * d.kdim) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory: expected ", len, " x ", d.kdim, " elements, got ", memory.size()));
  }
  if (value.empty() && d.kdim != d.vdim) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_value: required when kdim (", d.kdim, ") != vdim (", d.vdim, ")"));
  }
  if (!value.empty() && static_cast<int64_t>(value.size()) != len * d.vdim) {
    return absl::InvalidArgumentError(absl::StrCat("memory_value: expected ", len, " x ", d.vdim,
                                                   " elements, got ", value.size()));
  }
  if (key_padding.present() && key_padding.num_elements != len) {
    return absl::InvalidArgumentError(absl::StrCat("memory_key_padding_mask: expected ", len,
                                                   " elements, got ", key_padding.num_elements));
  }
  if (cache.length() != 0 || cache.capacity() < len) {
    return absl::InvalidArgumentError("ProjectEncoderMemory: the cache must be empty with room");
  }
  return GuardEngineCall(
      [&] { impl_->ProjectEncoderMemory(memory, value, len, key_padding, cache, ws); });
}

absl::Status EngineImpl::ValidateSteps(const StepBatch& batch, absl::Span<const float> output,
                                       absl::Span<const float> weights) const {
  const KvLayout layout = kv_layout();
  int64_t total = 0;
  absl::flat_hash_set<const KvCache*> caches;
  for (size_t i = 0; i < batch.steps.size(); ++i) {
    const CacheStep& step = batch.steps[i];
    if (step.cache == nullptr || step.tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, ": needs a cache and at least one token"));
    }
    if (!caches.insert(step.cache).second) {
      return absl::InvalidArgumentError(absl::StrCat("step ", i, ": a cache appears twice"));
    }
    const KvLayout& c = step.cache->layout();
    if (c.heads != layout.heads || c.qk_head_dim != layout.qk_head_dim ||
        c.v_head_dim != layout.v_head_dim || c.elem_bytes != layout.elem_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, ": the cache was made for another model"));
    }
    if (!step.cross && !CanAppendSelf()) {
      return absl::InvalidArgumentError(
          "self-attention sessions need kdim == vdim == embed_dim; this model "
          "has "
          "only cross-attention sessions");
    }
    if (!step.cross && step.cache->capacity() < step.cache->length() + step.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, ": the cache has no room for ", step.tokens, " tokens"));
    }
    total += step.tokens;
  }
  if (static_cast<int64_t>(batch.query.size()) != total * dims_.embed_dim ||
      static_cast<int64_t>(output.size()) != total * dims_.embed_dim) {
    return absl::InvalidArgumentError(absl::StrCat("append: query and output need ", total, " x ",
                                                   dims_.embed_dim, " elements, got ",
                                                   batch.query.size(), " and ", output.size()));
  }
  if (!weights.empty() && static_cast<int64_t>(weights.size()) != StepWeightsElements(batch)) {
    return absl::InvalidArgumentError(absl::StrCat("append weights: expected ",
                                                   StepWeightsElements(batch), " elements, got ",
                                                   weights.size()));
  }
  return absl::OkStatus();
}

void EngineImpl::ProjectEncoderMemory(absl::Span<const float> memory, absl::Span<const float> value,
                                      int64_t len, const MaskView& key_padding, KvCache& cache,
                                      Workspace& ws) const {
  const int64_t qk = dims_.qk_width(), vw = dims_.v_width();
  const int64_t eb = act_dt_ == dt::bf16 ? 2 : 4;
  const void* key = AsAct(memory, Workspace::kKeyBf16, ws);
  if (value.empty() && kv_ != nullptr) {  // one product for k and v
    auto* kv = ws.Get<uint8_t>(Workspace::kProjK, len * (qk + vw) * eb);
    kv_->Run(ws, key, len, kv);
    steps_->WriteCache(kv, qk + vw, kv + qk * eb, qk + vw, len, 0, cache);
  } else {
    const void* val = value.empty() ? key : AsAct(value, Workspace::kValueBf16, ws);
    auto* k = ws.Get<uint8_t>(Workspace::kProjK, len * qk * eb);
    auto* v = ws.Get<uint8_t>(Workspace::kProjV, len * vw * eb);
    k_->Run(ws, key, len, k);
    v_->Run(ws, val, len, v);
    steps_->WriteCache(k, qk, v, vw, len, 0, cache);
  }
  cache.set_length(len);
  if (key_padding.present()) {
    std::vector<float> additive(static_cast<size_t>(len));
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) {
      additive[i] = key_padding.dtype == DType::kF32
                        ? static_cast<const float*>(key_padding.data)[i]
                        : (static_cast<const uint8_t*>(key_padding.data)[i] != 0 ? neg_inf : 0.0f);
    }
    cache.set_key_padding(std::move(additive));
  }
}

}  // namespace mha
