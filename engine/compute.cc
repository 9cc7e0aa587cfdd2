// One engine call (MhaEngine::Compute): Attend rows and session steps,
// either of which may be empty, on one path. PlanCall decides from the
// shapes which projection products run; then the products, the steps'
// attention over their caches, the Attend rows' attention, one output product
// over all the rows and the post-norm.
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/ops/kernels.h"
#include "engine/status_macros.h"
#include "engine/thread_choice.h"
#include "engine/threads.h"

namespace mha {

using onednn::dt;

namespace {

// The calling thread's compute threads set to `n` until destroyed.
class ScopedComputeThreads {
 public:
  explicit ScopedComputeThreads(int n) : own_(ComputeThreads()) { SetComputeThreads(n); }
  ~ScopedComputeThreads() { SetComputeThreads(own_); }
  ScopedComputeThreads(const ScopedComputeThreads&) = delete;
  ScopedComputeThreads& operator=(const ScopedComputeThreads&) = delete;

 private:
  int own_;
};

}  // namespace

absl::Status MhaEngine::Compute(const AttentionBatch& attend, const StepBatch& steps,
                                const MixedOutputs& out, Workspace& ws) const {
  // A batch without offsets (default-constructed) stands for no Attend rows.
  const bool has_steps = !steps.steps.empty() || !steps.query.empty() ||
                         !out.step_weights.empty() || attend.q_offsets.empty();
  if (!has_steps) {  // Attend rows only
    RETURN_IF_ERROR(impl_->ValidateRun(attend, {out.output, out.weights, out.per_head_weights}));
    return GuardEngineCall([&] { impl_->Compute(attend, steps, out, ws); });
  }
  const int64_t e = impl_->dims().embed_dim;
  const int64_t q_rows = attend.num_rows() > 0 ? attend.q_offsets.back() : 0;
  if (q_rows < 0 || static_cast<int64_t>(out.output.size()) < q_rows * e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output: ", out.output.size(), " elements, fewer than the batch's ", q_rows, " x ", e));
  }
  if (attend.num_rows() > 0) {
    RETURN_IF_ERROR(impl_->ValidateRun(
        attend, {out.output.subspan(0, q_rows * e), out.weights, out.per_head_weights}));
  } else if (!out.weights.empty()) {
    return absl::InvalidArgumentError("weights: the batch has no sequences");
  }
  RETURN_IF_ERROR(impl_->ValidateSteps(steps, out.output.subspan(q_rows * e), out.step_weights));
  return GuardEngineCall([&] { impl_->Compute(attend, steps, out, ws); });
}

absl::Status MhaEngine::Run(const AttentionBatch& batch, const AttentionOutputs& out,
                            Workspace& ws) const {
  RETURN_IF_ERROR(impl_->ValidateRun(batch, out));
  return Compute(batch, {}, {out.output, out.weights, out.per_head_weights, {}}, ws);
}

EngineImpl::CallPlan EngineImpl::PlanCall(const AttentionBatch& attend,
                                          const StepBatch& steps) const {
  CallPlan plan;
  plan.sequence_rows = attend.num_rows() > 0 ? attend.q_offsets.back() : 0;
  plan.step_rows = static_cast<int64_t>(steps.query.size()) / dims_.embed_dim;
  if (plan.step_rows == 0) {
    plan.projection = CallPlan::kSequences;
  } else if (plan.sequence_rows == 0) {
    plan.projection = CallPlan::kSteps;
  } else if (attend.self_attention() || !AnySelfStep(steps)) {
    plan.projection = CallPlan::kJoint;
  } else {
    plan.projection = CallPlan::kSeparate;
  }
  return plan;
}

void EngineImpl::ProjectCall(const CallPlan& plan, const AttentionBatch& attend,
                             const StepBatch& steps, Workspace& ws, TokenMajor& t,
                             StepRows& s) const {
  const int64_t e = dims_.embed_dim, qk = dims_.qk_width(), vw = dims_.v_width();
  const int64_t eb = act_dt_ == dt::bf16 ? 2 : 4;
  const int64_t in_eb = in_dt_ == dt::bf16 ? 2 : 4;  // the rows projected
  const int64_t total = plan.sequence_rows + plan.step_rows;
  switch (plan.projection) {
    case CallPlan::kSequences:
      t = ProjectTokens(attend, ws);
      return;
    case CallPlan::kSteps: {
      // q|k|v when any step appends (a cross step's k and v are then
      // computed and ignored), q only when all steps are cross.
      const bool any_self = AnySelfStep(steps);
      s.ld = any_self ? 2 * qk + vw : qk;
      auto* proj = ws.Get<uint8_t>(Workspace::kProjQ, total * s.ld * eb);
      (any_self ? qkv_ : q_)
          ->Run(ws, AsAct(steps.query, Workspace::kQueryBf16, ws), plan.step_rows, proj);
      s.proj = proj;
      return;
    }
    case CallPlan::kJoint: {
      // One layer serves both kinds of rows (q|k|v for a self-attention
      // batch, whose rows give the steps' q, k and v alike; q for a cross
      // batch with cross steps only): one product, over the rows as given
      // when the steps' follow the batch's (RaggedBatch's rows_after), else
      // over a copy of both.
      const bool adjacent =
          in_dt_ == dt::f32 && steps.query.data() == attend.query.data() + attend.query.size();
      const void* rows = attend.query.data();
      if (!adjacent) {
        auto* copy = ws.Get<uint8_t>(Workspace::kMixedQuery, total * e * in_eb);
        const int64_t q_elems = plan.sequence_rows * e, s_elems = plan.step_rows * e;
        if (in_dt_ == dt::f32) {
          std::memcpy(copy, attend.query.data(), q_elems * sizeof(float));
          std::memcpy(copy + q_elems * in_eb, steps.query.data(), s_elems * sizeof(float));
        } else {
          auto* bf16 = reinterpret_cast<uint16_t*>(copy);
          ConvertToBf16(attend.query.data(), bf16, q_elems);
          ConvertToBf16(steps.query.data(), bf16 + q_elems, s_elems);
        }
        rows = copy;
      }
      const int64_t ld = attend.self_attention() ? 2 * qk + vw : qk;
      auto* proj = ws.Get<uint8_t>(Workspace::kProjQ, total * ld * eb);
      (attend.self_attention() ? qkv_ : q_)->Run(ws, rows, total, proj);
      t.q = proj, t.ldq = ld;
      if (attend.self_attention()) {
        t.k = proj + qk * eb, t.v = proj + 2 * qk * eb, t.ldk = t.ldv = ld;
      } else {
        ProjectKeysValues(attend, ws, t);
      }
      s.proj = proj + plan.sequence_rows * ld * eb;
      s.ld = ld;
      return;
    }
    case CallPlan::kSeparate: {
      // A cross batch beside self steps: q for one, q|k|v for the other.
      t = ProjectTokens(attend, ws);
      s.ld = 2 * qk + vw;
      auto* proj = ws.Get<uint8_t>(Workspace::kStepProj, plan.step_rows * s.ld * eb);
      qkv_->Run(ws, AsAct(steps.query, Workspace::kMixedQuery, ws), plan.step_rows, proj);
      s.proj = proj;
      return;
    }
  }
}

double EngineImpl::AttendMacs(const AttentionBatch& attend) const {
  const AttentionDims& d = dims_;
  const double qk = static_cast<double>(d.qk_width()), vw = static_cast<double>(d.v_width());
  const double e = static_cast<double>(d.embed_dim);
  const std::vector<int64_t>& q_off = attend.q_offsets;
  const std::vector<int64_t>& kv_off = attend.self_attention() ? q_off : attend.kv_offsets;
  const double q_rows = static_cast<double>(q_off.back());
  const double kv_rows = static_cast<double>(kv_off.back());
  double macs = q_rows * e * qk + kv_rows * (d.kdim * qk + d.vdim * vw) + q_rows * vw * e;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(q_off.size()); ++b) {
    const double keys = static_cast<double>(kv_off[b + 1] - kv_off[b] + d.extra_keys());
    macs += static_cast<double>(q_off[b + 1] - q_off[b]) * keys * (qk + vw);
  }
  return macs;
}

void EngineImpl::Compute(const AttentionBatch& attend, const StepBatch& steps,
                         const MixedOutputs& out, Workspace& ws) const {
  const CallPlan plan = PlanCall(attend, steps);
  if (plan.sequence_rows + plan.step_rows == 0) return;
  // Steps read their caches (bytes, not multiply-adds): they keep all
  // threads. A call may run on one thread only where its primitives are
  // warm: warm-up makes them for each of CallThreadCounts (the server's
  // worker pool includes 1 when it runs calls side by side).
  if (!choose_threads_ || plan.step_rows > 0 || ComputeThreads() <= 1 ||
      !CallThreadCountsInclude(1)) {
    return ComputePlanned(plan, attend, steps, out, ws);
  }
  const double macs = AttendMacs(attend);
  const int kind = dims_.int8 ? 2 : act_dt_ == dt::bf16 ? 1 : 0;
  const ThreadChoice::Pick pick = ThreadChoice::Shared().Choose(kind, macs, ComputeThreads());
  if (pick.slot < 0) return ComputePlanned(plan, attend, steps, out, ws);
  const auto start = std::chrono::steady_clock::now();
  {
    ScopedComputeThreads threads(pick.serial ? 1 : ComputeThreads());
    ComputePlanned(plan, attend, steps, out, ws);
  }
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  ThreadChoice::Shared().Record(pick, macs, took.count());
}

void EngineImpl::ComputePlanned(const CallPlan& plan, const AttentionBatch& attend,
                                const StepBatch& steps, const MixedOutputs& out,
                                Workspace& ws) const {
  const int64_t e = dims_.embed_dim, vw = dims_.v_width();
  const int64_t eb = act_dt_ == dt::bf16 ? 2 : 4;
  const int64_t q_rows = plan.sequence_rows, s_rows = plan.step_rows, total = q_rows + s_rows;
  TokenMajor t;
  StepRows s;
  ProjectCall(plan, attend, steps, ws, t, s);
  if (q_rows > 0) ws.BetweenBlocks();  // a long call's projection may take a while
  // The steps first: they read their projected rows, which the Attend rows'
  // merged context overwrites below.
  uint8_t* context = nullptr;
  if (s_rows > 0) {
    context = ws.Get<uint8_t>(Workspace::kStepContext, s_rows * vw * eb);
    steps_->Attend(steps, s.proj, s.ld, context, out.step_weights, ws);
  }
  if (q_rows > 0) {
    // Both contexts back to back, for one output product.
    const uint8_t* step_context = context;
    context = sequences_->Attend(
        t, attend, {out.output.subspan(0, q_rows * e), out.weights, out.per_head_weights}, total,
        ws);
    if (s_rows > 0) std::memcpy(context + q_rows * vw * eb, step_context, s_rows * vw * eb);
  }
  out_->Run(ws, context, total, out.output.data());
  if (dims_.post_norm) {
    if (q_rows > 0) {
      AddLayerNorm(out.output.data(), attend.query.data(), norm_weight_.data(), norm_bias_.data(),
                   q_rows, e, dims_.norm_eps);
    }
    if (s_rows > 0) {
      AddLayerNorm(out.output.data() + q_rows * e, steps.query.data(), norm_weight_.data(),
                   norm_bias_.data(), s_rows, e, dims_.norm_eps);
    }
  }
}

}  // namespace mha
