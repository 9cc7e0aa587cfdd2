#include "client/session_command.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "client/client_common.h"

namespace mha::client {
namespace {

// Rows [first, first + count) of a [1, L, width] FP32 tensor.
v1::Tensor Rows(const v1::Tensor& t, int64_t first, int64_t count, int64_t width) {
  v1::Tensor out;
  out.set_dtype(v1::DATA_TYPE_FP32);
  out.add_shape(1);
  out.add_shape(count);
  out.add_shape(width);
  out.set_data(t.data().substr(first * width * 4, count * width * 4));
  return out;
}

float MaxDiff(const std::vector<float>& want, const std::vector<float>& got) {
  float max_diff = want.size() == got.size() ? 0.0f : INFINITY;
  for (size_t i = 0; i < std::min(want.size(), got.size()); ++i) {
    const float d = std::fabs(want[i] - got[i]);
    max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
  }
  return max_diff;
}

// `sequence`'s tokens [first, first + count) with `tail`'s after them
// replacing the rest: a fork's whole sequence.
v1::Tensor Spliced(const v1::Tensor& sequence, const v1::Tensor& tail, int64_t keep,
                   int64_t width) {
  v1::Tensor out = sequence;
  out.mutable_data()->replace(keep * width * 4, std::string::npos,
                              tail.data().substr(keep * width * 4));
  return out;
}

// Whether a step that failed with `status` may have been applied: then the
// same step, sent again, is answered (again) either way.
bool MayHaveBeenApplied(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
         status.error_code() == grpc::StatusCode::UNAVAILABLE;
}

// Sends `append`, and again (the same expected_position) up to `retries`
// times while its answer is lost.
grpc::Status AppendWithRetries(v1::AttentionService::Stub& stub,
                               const std::function<std::unique_ptr<grpc::ClientContext>()>& context,
                               const v1::AppendRequest& append, int64_t retries,
                               v1::AppendResponse& response) {
  grpc::Status status = stub.Append(context().get(), append, &response);
  for (int64_t i = 0; i < retries && MayHaveBeenApplied(status); ++i) {
    std::fprintf(stderr, "step at expected_position %lld: %s; sent again\n",
                 static_cast<long long>(append.expected_position()),
                 status.error_message().c_str());
    status = stub.Append(context().get(), append, &response);
  }
  return status;
}

}  // namespace

int RunSession(v1::AttentionService::Stub& stub, const SessionCommandOptions& o) {
  v1::GetModelRequest get;
  get.set_name(o.model);
  v1::ModelInfo info;
  grpc::Status status = stub.GetModel(o.context().get(), get, &info);
  if (!status.ok()) return ReportError(status);
  const int64_t e = info.embed_dim(), total = o.steps * o.step_tokens;
  std::mt19937 gen(o.seed);
  const v1::Tensor sequence = RandomTensor({1, total, e}, gen);
  // The id is chosen here and sent as x-session-id with every call of the
  // session, OpenSession included: a balancer hashing on it sends them all
  // to the replica that holds the session.
  std::random_device entropy;  // not the seed: two runs must not share an id
  const std::string id = absl::StrFormat("cli-%08x%08x", entropy(), entropy());
  auto session_context = [&] {
    std::unique_ptr<grpc::ClientContext> context = o.context();
    context->AddMetadata("x-session-id", id);
    return context;
  };
  v1::OpenSessionRequest open;
  open.set_model(o.model);
  open.set_session_id(id);
  if (o.memory_len > 0) {
    *open.mutable_memory() = RandomTensor({1, o.memory_len, info.kdim()}, gen);
    *open.mutable_memory_value() = RandomTensor({1, o.memory_len, info.vdim()}, gen);
  }
  v1::Session session;
  status = stub.OpenSession(session_context().get(), open, &session);
  if (!status.ok()) return ReportError(status);
  std::printf("session %s on %s version %lld (%s), position %lld\n", session.session_id().c_str(),
              session.model().c_str(), static_cast<long long>(session.model_version()),
              session.cross() ? "cross-attention" : "self-attention",
              static_cast<long long>(session.position()));
  std::vector<float> outputs;
  std::vector<double> step_ms;
  int64_t position = session.position();
  v1::Session fork;  // with --fork_at: the branch made after that many steps
  std::vector<float> fork_outputs;
  for (int64_t step = 0; step < o.steps; ++step) {
    if (o.fork_at > 0 && step == o.fork_at) {
      v1::ForkSessionRequest request;
      request.set_session_id(session.session_id());
      request.set_new_session_id(id + "-fork");
      status = stub.ForkSession(session_context().get(), request, &fork);
      if (!status.ok()) return ReportError(status);
      std::printf("forked %s at position %lld\n", fork.session_id().c_str(),
                  static_cast<long long>(fork.position()));
    }
    v1::AppendRequest append;
    append.set_session_id(session.session_id());
    *append.mutable_query() = Rows(sequence, step * o.step_tokens, o.step_tokens, e);
    append.set_expected_position(position);
    v1::AppendResponse response;
    const auto sent = std::chrono::steady_clock::now();
    status = AppendWithRetries(stub, session_context, append, o.retries, response);
    step_ms.push_back(Milliseconds(std::chrono::steady_clock::now() - sent));
    if (!status.ok()) return ReportError(status);
    if (step == o.resend_step) {  // as if this answer had been lost
      v1::AppendResponse again;
      status = AppendWithRetries(stub, session_context, append, o.retries, again);
      if (!status.ok()) return ReportError(status);
      const bool same = again.output().data() == response.output().data() &&
                        again.position() == response.position();
      std::printf("step %lld sent again at expected_position %lld: %s, position %lld\n",
                  static_cast<long long>(step), static_cast<long long>(position),
                  same ? "the same answer (bit for bit)" : "ANOTHER ANSWER",
                  static_cast<long long>(again.position()));
      if (!same) return 1;
    }
    position = response.position();
    const std::vector<float> out = TensorValues(response.output());
    outputs.insert(outputs.end(), out.begin(), out.end());
    if (!o.quiet) {
      std::printf("step %3lld: %lld token(s), position %lld, %.3f ms\n",
                  static_cast<long long>(step), static_cast<long long>(o.step_tokens),
                  static_cast<long long>(position), step_ms.back());
    }
  }
  // The fork's own continuation, from the fork point on.
  const v1::Tensor fork_sequence =
      fork.session_id().empty()
          ? sequence
          : Spliced(sequence, RandomTensor({1, total, e}, gen), o.fork_at * o.step_tokens, e);
  for (int64_t step = o.fork_at; !fork.session_id().empty() && step < o.steps; ++step) {
    v1::AppendRequest append;
    append.set_session_id(fork.session_id());
    *append.mutable_query() = Rows(fork_sequence, step * o.step_tokens, o.step_tokens, e);
    v1::AppendResponse response;
    status = stub.Append(session_context().get(), append, &response);
    if (!status.ok()) return ReportError(status);
    const std::vector<float> out = TensorValues(response.output());
    fork_outputs.insert(fork_outputs.end(), out.begin(), out.end());
  }
  // The same sequence in one Attend: causal over itself, or over the memory.
  v1::AttendRequest attend;
  attend.set_model(o.model);
  attend.set_model_version(session.model_version());
  *attend.mutable_query() = sequence;
  if (o.memory_len > 0) {
    *attend.mutable_key() = open.memory();
    *attend.mutable_value() = open.memory_value();
  } else {
    attend.set_is_causal(true);
  }
  v1::AttendResponse full;
  const auto sent = std::chrono::steady_clock::now();
  status = stub.Attend(o.context().get(), attend, &full);
  const double full_ms = Milliseconds(std::chrono::steady_clock::now() - sent);
  if (!status.ok()) return ReportError(status);
  const std::vector<float> want = TensorValues(full.output());
  const float max_diff = MaxDiff(want, outputs);
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  std::printf(
      "%lld steps: median %.3f ms, max %.3f ms; one Attend over all %lld tokens: "
      "%.3f ms\n",
      static_cast<long long>(o.steps), sorted[sorted.size() / 2], sorted.back(),
      static_cast<long long>(total), full_ms);
  bool ok = max_diff <= kSessionCheckTolerance;
  std::printf("check against one Attend%s: max |diff| %.3g %s\n",
              o.memory_len > 0 ? " over the memory" : " with is_causal", max_diff,
              ok ? "OK" : "MISMATCH");
  if (!fork.session_id().empty()) {
    *attend.mutable_query() = fork_sequence;
    status = stub.Attend(o.context().get(), attend, &full);
    if (!status.ok()) return ReportError(status);
    // The fork answered the steps from the fork point on.
    std::vector<float> want_fork = TensorValues(full.output());
    want_fork.erase(want_fork.begin(), want_fork.begin() + o.fork_at * o.step_tokens * e);
    const float fork_diff = MaxDiff(want_fork, fork_outputs);
    const bool fork_ok = fork_diff <= kSessionCheckTolerance;
    std::printf(
        "fork's continuation against one Attend over its whole sequence: max |diff| "
        "%.3g %s\n",
        fork_diff, fork_ok ? "OK" : "MISMATCH");
    ok = ok && fork_ok;
    v1::CloseSessionRequest close;
    close.set_session_id(fork.session_id());
    v1::CloseSessionResponse closed;
    status = stub.CloseSession(session_context().get(), close, &closed);
    if (!status.ok()) return ReportError(status);
  }
  v1::CloseSessionRequest close;
  close.set_session_id(session.session_id());
  v1::CloseSessionResponse closed;
  status = stub.CloseSession(session_context().get(), close, &closed);
  if (!status.ok()) return ReportError(status);
  std::printf("closed: %lld bytes freed\n", static_cast<long long>(closed.freed_bytes()));
  return ok ? 0 : 1;
}

}  // namespace mha::client
