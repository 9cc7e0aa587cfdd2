#include "engine/mha_engine.h"

#include <cstring>
#include <exception>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/ops/kernels.h"
#include "engine/status_macros.h"
#include "engine/threads.h"

namespace mha {
namespace {

using dims = dnnl::memory::dims;
using onednn::ActSize;
using onednn::dt;

std::vector<uint8_t> RowInType(const std::vector<float>& row, dt type) {
  std::vector<uint8_t> bytes(row.size() * ActSize(type));
  if (type == dt::bf16) {
    ConvertToBf16(row.data(), reinterpret_cast<uint16_t*>(bytes.data()),
                  static_cast<int64_t>(row.size()));
  } else {
    std::memcpy(bytes.data(), row.data(), bytes.size());
  }
  return bytes;
}

// Concatenates [n1, k] and [n2, k] row-major weight matrices (and biases).
std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// Every packed tensor has the size `dims` implies (PackWeights guarantees it;
// this guards direct callers of Create).
absl::Status CheckWeightSizes(const AttentionDims& d, const PackedWeights& w) {
  const int64_t e = d.embed_dim, qk = d.qk_width(), v = d.v_width();
  const std::pair<const std::vector<float>*, int64_t> expected[] = {
      {&w.w_q, qk * e},
      {&w.w_k, qk * d.kdim},
      {&w.w_v, v * d.vdim},
      {&w.b_q, qk},
      {&w.b_k, qk},
      {&w.b_v, v},
      {&w.w_o, e * v},
      {&w.b_o, e},
      {&w.bias_k, d.add_bias_kv ? qk : 0},
      {&w.bias_v, d.add_bias_kv ? v : 0},
      {&w.norm_weight, d.post_norm ? e : 0},
      {&w.norm_bias, d.post_norm ? e : 0}};
  for (const auto& [vec, size] : expected) {
    if (static_cast<int64_t>(vec->size()) != size) {
      return absl::InvalidArgumentError(absl::StrCat("packed weights: a tensor has ", vec->size(),
                                                     " elements where the config implies ", size));
    }
  }
  return absl::OkStatus();
}

}  // namespace

EngineImpl::EngineImpl(const AttentionDims& dims, const PackedWeights& w,
                       const EngineOptions& options)
    : dims_(dims),
      engine_(onednn::CpuEngine()),
      act_dt_(dims.bf16 ? dt::bf16 : dt::f32),
      in_dt_(dims.int8 ? dt::f32 : act_dt_),
      choose_threads_(options.choose_small_call_threads) {
  const int64_t e = dims.embed_dim, qk = dims.qk_width(), v = dims.v_width();
  const LinearPrecision precision =
      dims.int8 ? LinearPrecision::kInt8 : LinearPrecision::kActivations;
  if (dims.kdim == e && dims.vdim == e) {
    qkv_ = std::make_unique<LinearLayer>(engine_, Stack({&w.w_q, &w.w_k, &w.w_v}),
                                         Stack({&w.b_q, &w.b_k, &w.b_v}), 2 * qk + v, e, in_dt_,
                                         act_dt_, precision);
  }
  // The q, k/v, k and v layers of cross calls are column ranges of the
  // stacked layer: they read its packed weights in place where this
  // machine's packed format allows (LinearLayer::ColumnsOf), so the weights
  // are packed once; elsewhere they pack their own.
  auto columns_or_own = [&](const LinearLayer* fused, int64_t first, int64_t count, int64_t k,
                            std::initializer_list<const std::vector<float>*> weights,
                            std::initializer_list<const std::vector<float>*> biases) {
    std::unique_ptr<LinearLayer> part;
    if (fused != nullptr) part = LinearLayer::ColumnsOf(*fused, first, count);
    if (part == nullptr) {
      part = std::make_unique<LinearLayer>(engine_, Stack(weights), Stack(biases), count, k, in_dt_,
                                           act_dt_, precision);
    }
    return part;
  };
  q_ = columns_or_own(qkv_.get(), 0, qk, e, {&w.w_q}, {&w.b_q});
  if (dims.kdim == dims.vdim) {
    kv_ = columns_or_own(qkv_.get(), qk, qk + v, dims.kdim, {&w.w_k, &w.w_v}, {&w.b_k, &w.b_v});
  }
  const LinearLayer* kv = qkv_ != nullptr ? qkv_.get() : kv_.get();
  const int64_t k0 = qkv_ != nullptr ? qk : 0;
  k_ = columns_or_own(kv, k0, qk, dims.kdim, {&w.w_k}, {&w.b_k});
  v_ = columns_or_own(kv, k0 + qk, v, dims.vdim, {&w.w_v}, {&w.b_v});
  out_ = std::make_unique<LinearLayer>(engine_, w.w_o, w.b_o, e, v, act_dt_, dt::f32, precision);
  std::vector<uint8_t> bias_k, bias_v;  // one row each in the compute type
  if (dims.add_bias_kv) {
    bias_k = RowInType(w.bias_k, act_dt_);
    bias_v = RowInType(w.bias_v, act_dt_);
  }
  norm_weight_ = w.norm_weight;
  norm_bias_ = w.norm_bias;
  sequences_ = std::make_unique<const RequestAttention>(dims, options, act_dt_, bias_k, bias_v);
  steps_ =
      std::make_unique<const StepAttention>(dims, act_dt_, std::move(bias_k), std::move(bias_v));
}

MhaEngine::MhaEngine(std::unique_ptr<const EngineImpl> impl) : impl_(std::move(impl)) {}
MhaEngine::~MhaEngine() = default;

absl::StatusOr<std::unique_ptr<MhaEngine>> MhaEngine::Create(const AttentionDims& dims,
                                                             const PackedWeights& weights,
                                                             const EngineOptions& options) {
  RETURN_IF_ERROR(CheckWeightSizes(dims, weights));
  // Where oneDNN has no bf16 kernels, a bf16 model computes in fp32: the
  // same answers, more precise (the caller can tell from dims().bf16).
  AttentionDims computed = dims;
  if (computed.bf16 && !CpuCanComputeBf16()) computed.bf16 = false;
  // An int8 model's core is bf16 only where bf16 is native (emulated, it is
  // slower than fp32); its projections int8 only where int8 dot products
  // are (dims().int8 tells).
  if (computed.int8 && !CpuHasNativeBf16()) computed.bf16 = false;
  if (computed.int8 && !CpuHasInt8Dot()) computed.int8 = false;
  try {
    return std::unique_ptr<MhaEngine>(
        new MhaEngine(std::make_unique<const EngineImpl>(computed, weights, options)));
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("engine creation failed: ", e.what()));
  }
}

std::unique_ptr<Workspace> MhaEngine::NewWorkspace() {
  return std::make_unique<Workspace>(onednn::CpuEngine());
}

bool MhaEngine::ReleaseLargeWorkspace(Workspace& ws) {
  return ws.ReleaseIfAbove(kWorkspaceKeepBytes);
}

int64_t MhaEngine::WeightsElements(const AttentionBatch& batch, bool per_head) const {
  return impl_->WeightsElements(batch, per_head);
}

int64_t MhaEngine::ScratchBytes(const BatchShape& shape, int threads) const {
  return impl_->ScratchBytes(shape, threads);
}

int64_t MhaEngine::StepScratchBytes(int64_t tokens, int64_t keys, bool need_weights,
                                    int threads) const {
  return impl_->StepScratchBytes(tokens, keys, need_weights, threads);
}

uint64_t MhaEngine::PrimitiveCacheMisses() const { return impl_->PrimitiveCacheMisses(); }

int64_t MhaEngine::WeightBytes() const { return impl_->WeightBytes(); }

const AttentionDims& MhaEngine::dims() const { return impl_->dims(); }

int64_t EngineImpl::WeightsElements(const AttentionBatch& batch, bool per_head) const {
  const std::vector<int64_t>& kv = batch.self_attention() ? batch.q_offsets : batch.kv_offsets;
  int64_t total = 0;
  for (int64_t b = 0; b < batch.num_rows(); ++b) {
    const int64_t s = kv[b + 1] - kv[b] + dims_.extra_keys();
    total += (batch.q_offsets[b + 1] - batch.q_offsets[b]) * s;
  }
  return per_head ? total * dims_.num_heads : total;
}

absl::Status EngineImpl::ValidateRun(const AttentionBatch& batch,
                                     const AttentionOutputs& out) const {
  RETURN_IF_ERROR(ValidateBatch(dims_, batch, out));
  if (!out.weights.empty()) {
    const int64_t expected = WeightsElements(batch, out.per_head_weights);
    if (static_cast<int64_t>(out.weights.size()) != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: expected ", expected, " elements, got ", out.weights.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status EngineErrorStatus(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CallStopped&) {
    return absl::CancelledError("the call stopped at a yield point: nobody waits for it");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory while computing attention");
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory) {
      return absl::ResourceExhaustedError(absl::StrCat("oneDNN out of memory: ", e.what()));
    }
    return absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("attention failed: ", e.what()));
  } catch (...) {
    return absl::InternalError("attention failed");
  }
}

const void* EngineImpl::AsAct(absl::Span<const float> x, Workspace::Slot slot,
                              Workspace& ws) const {
  if (in_dt_ == dt::f32) return x.data();
  auto* converted = ws.Get<uint16_t>(slot, x.size());
  ConvertToBf16(x.data(), converted, static_cast<int64_t>(x.size()));
  return converted;
}

TokenMajor EngineImpl::ProjectTokens(const AttentionBatch& batch, Workspace& ws) const {
  const int64_t qk = dims_.qk_width(), v = dims_.v_width();
  const int64_t total_q = batch.q_offsets.back();
  const size_t act = ActSize(act_dt_);
  TokenMajor t;
  const void* query = AsAct(batch.query, Workspace::kQueryBf16, ws);
  if (batch.self_attention()) {  // one product for q, k and v
    auto* qkv = ws.Get<uint8_t>(Workspace::kProjQ, total_q * (2 * qk + v) * act);
    qkv_->Run(ws, query, total_q, qkv);
    t.q = qkv, t.k = qkv + qk * act, t.v = qkv + 2 * qk * act;
    t.ldq = t.ldk = t.ldv = 2 * qk + v;
    return t;
  }
  auto* q = ws.Get<uint8_t>(Workspace::kProjQ, total_q * qk * act);
  q_->Run(ws, query, total_q, q);
  t.q = q, t.ldq = qk;
  ProjectKeysValues(batch, ws, t);
  return t;
}

void EngineImpl::ProjectKeysValues(const AttentionBatch& batch, Workspace& ws,
                                   TokenMajor& t) const {
  const int64_t qk = dims_.qk_width(), v = dims_.v_width();
  const size_t act = ActSize(act_dt_);
  const int64_t total_kv = batch.kv_offsets.back();
  const void* key = AsAct(batch.key, Workspace::kKeyBf16, ws);
  const bool same = batch.value_is_key();
  if (same && kv_ != nullptr) {  // one product for k and v
    auto* kv = ws.Get<uint8_t>(Workspace::kProjK, total_kv * (qk + v) * act);
    kv_->Run(ws, key, total_kv, kv);
    t.k = kv, t.v = kv + qk * act, t.ldk = t.ldv = qk + v;
    return;
  }
  const void* value = same ? key : AsAct(batch.value, Workspace::kValueBf16, ws);
  auto* k = ws.Get<uint8_t>(Workspace::kProjK, total_kv * qk * act);
  auto* vv = ws.Get<uint8_t>(Workspace::kProjV, total_kv * v * act);
  k_->Run(ws, key, total_kv, k);
  v_->Run(ws, value, total_kv, vv);
  t.k = k, t.v = vv, t.ldk = qk, t.ldv = v;
}

}  // namespace mha
