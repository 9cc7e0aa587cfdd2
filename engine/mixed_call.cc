// Attend sequences and session steps in one engine call (MhaEngine's mixed
// Run, and EngineImpl::ComputeMixed).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/ops/kernels.h"
#include "engine/status_macros.h"

namespace mha {

using onednn::dt;

absl::Status MhaEngine::Run(const AttentionBatch& batch, const AppendBatch& steps,
                            const MixedOutputs& out, Workspace& ws) const {
  const int64_t e = impl_->dims().embed_dim;
  const int64_t q_rows = batch.num_sequences() > 0 ? batch.q_offsets.back() : 0;
  if (q_rows < 0 || static_cast<int64_t>(out.output.size()) < q_rows * e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output: ", out.output.size(), " elements, fewer than the batch's ", q_rows, " x ", e));
  }
  const AttentionOutputs batch_out{out.output.subspan(0, q_rows * e), out.weights,
                                   out.per_head_weights};
  const AppendOutputs steps_out{out.output.subspan(q_rows * e), out.step_weights};
  if (steps.steps.empty() && steps.query.empty() && out.step_weights.empty()) {
    return Run(batch, batch_out, ws);
  }
  if (batch.num_sequences() == 0) {
    if (!out.weights.empty()) {
      return absl::InvalidArgumentError("weights: the batch has no sequences");
    }
    return Append(steps, steps_out, ws);
  }
  RETURN_IF_ERROR(impl_->ValidateRun(batch, batch_out));
  RETURN_IF_ERROR(impl_->ValidateSteps(steps, steps_out.output, steps_out.weights));
  return GuardEngineCall([&] { impl_->ComputeMixed(batch, steps, out, ws); });
}

void EngineImpl::ComputeMixed(const AttentionBatch& batch, const AppendBatch& steps,
                              const MixedOutputs& out, Workspace& ws) const {
  const int64_t e = dims_.embed_dim, qk = dims_.qk_width(), vw = dims_.v_width();
  const int64_t eb = act_dt_ == dt::bf16 ? 2 : 4;
  const int64_t total_q = batch.q_offsets.back();
  const int64_t total_s = static_cast<int64_t>(steps.query.size()) / e;
  const int64_t total = total_q + total_s;
  // The projection: one product over both kinds of rows when one layer
  // serves both (q|k|v for a self-attention batch, whose rows give the
  // steps' q, k and v alike; q for a cross-attention batch with cross
  // steps only). A cross batch with self steps needs q for one and q|k|v
  // for the other: two products.
  TokenMajor t;
  const uint8_t* step_proj = nullptr;
  int64_t step_ld = 0;
  if (batch.self_attention() || !AnySelfStep(steps)) {
    // Both kinds of rows in one buffer: as given when the steps' rows follow
    // the batch's (RaggedBatch's rows_after), else copied.
    const bool adjacent = act_dt_ == dt::f32 &&
                          steps.query.data() == batch.query.data() + batch.query.size();
    const void* rows = batch.query.data();
    if (!adjacent) {
      auto* copy = ws.Get<uint8_t>(Workspace::kMixedQuery, total * e * eb);
      if (act_dt_ == dt::f32) {
        std::memcpy(copy, batch.query.data(), total_q * e * sizeof(float));
        std::memcpy(copy + total_q * e * eb, steps.query.data(), total_s * e * sizeof(float));
      } else {
        auto* bf16 = reinterpret_cast<uint16_t*>(copy);
        ConvertToBf16(batch.query.data(), bf16, total_q * e);
        ConvertToBf16(steps.query.data(), bf16 + total_q * e, total_s * e);
      }
      rows = copy;
    }
    const int64_t ld = batch.self_attention() ? 2 * qk + vw : qk;
    auto* proj = ws.Get<uint8_t>(Workspace::kProjQ, total * ld * eb);
    (batch.self_attention() ? qkv_ : q_)->Run(ws, rows, total, proj);
    t.q = proj, t.ldq = ld;
    if (batch.self_attention()) {
      t.k = proj + qk * eb, t.v = proj + 2 * qk * eb, t.ldk = t.ldv = ld;
    } else {
      ProjectKeysValues(batch, ws, t);
    }
    step_proj = proj + total_q * ld * eb;
    step_ld = ld;
  } else {
    t = ProjectTokens(batch, ws);
    step_ld = 2 * qk + vw;
    auto* proj = ws.Get<uint8_t>(Workspace::kStepProj, total_s * step_ld * eb);
    qkv_->Run(ws, AsAct(steps.query, Workspace::kMixedQuery, ws), total_s, proj);
    step_proj = proj;
  }
  // The steps first: they read their projected rows, which the batch's
  // merged context overwrites below.
  auto* step_context = ws.Get<uint8_t>(Workspace::kStepContext, total_s * vw * eb);
  AttendSteps(steps, step_proj, step_ld, step_context, out.step_weights, ws);
  const bool weights = !out.weights.empty();
  const AttentionOutputs batch_out{out.output.subspan(0, total_q * e), out.weights,
                                   out.per_head_weights};
  const Projected p = Project(t, batch, weights, ws);
  AttendSequences(p, batch, batch_out, ws);
  // Both contexts back to back in the (dead) projection buffer, one
  // output product.
  auto* context = ws.Get<uint8_t>(Workspace::kProjQ, total * vw * eb);
  MergeContexts(p, batch, weights, context);
  std::memcpy(context + total_q * vw * eb, step_context, total_s * vw * eb);
  out_->Run(ws, context, total, out.output.data());
  if (dims_.post_norm) {
    AddLayerNorm(out.output.data(), batch.query.data(), norm_weight_.data(), norm_bias_.data(),
                 total_q, e, dims_.norm_eps);
    AddLayerNorm(out.output.data() + total_q * e, steps.query.data(), norm_weight_.data(),
                 norm_bias_.data(), total_s, e, dims_.norm_eps);
  }
}

}  // namespace mha
