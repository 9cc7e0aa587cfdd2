#include "client/session_load.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client_common.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::client {
namespace {

using Clock = std::chrono::steady_clock;

// What one session's thread measured.
struct SessionRun {
  std::vector<double> step_ms;
  std::map<std::string, int64_t> errors;
};

std::unique_ptr<grpc::ClientContext> SessionContext(const std::string& token,
                                                    const std::string& id) {
  auto context = std::make_unique<grpc::ClientContext>();
  AddToken(token, *context);
  context->AddMetadata("x-session-id", id);
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return context;
}

void RunUnary(v1::AttentionService::Stub& stub, const SessionLoadOptions& o, const std::string& id,
              std::mt19937& gen, SessionRun& run) {
  v1::OpenSessionRequest open;
  open.set_model(o.target.model);
  open.set_session_id(id);
  v1::Session session;
  grpc::Status status = stub.OpenSession(SessionContext(o.token, id).get(), open, &session);
  if (!status.ok()) {
    ++run.errors[CodeName(status.error_code())];
    return;
  }
  for (int64_t step = 0; step < o.steps; ++step) {
    v1::AppendRequest append;
    append.set_session_id(id);
    *append.mutable_query() = RandomTensor({1, o.step_tokens, o.target.embed_dim}, gen);
    v1::AppendResponse response;
    const auto sent = Clock::now();
    status = stub.Append(SessionContext(o.token, id).get(), append, &response);
    if (!status.ok()) {
      ++run.errors[CodeName(status.error_code())];
      break;
    }
    run.step_ms.push_back(Milliseconds(Clock::now() - sent));
  }
  v1::CloseSessionRequest close;
  close.set_session_id(id);
  v1::CloseSessionResponse closed;
  stub.CloseSession(SessionContext(o.token, id).get(), close, &closed);
}

void RunStream(v1::AttentionService::Stub& stub, const SessionLoadOptions& o, const std::string& id,
               std::mt19937& gen, SessionRun& run) {
  std::unique_ptr<grpc::ClientContext> context = SessionContext(o.token, id);
  auto stream = stub.Stream(context.get());
  // Writes one message and reads its answer; false on a broken stream.
  auto call = [&](v1::StreamRequest request, v1::StreamResponse& response) {
    if (!stream->Write(request) || !stream->Read(&response)) {
      ++run.errors["UNAVAILABLE"];
      return false;
    }
    if (response.code() != 0) {
      ++run.errors[CodeName(static_cast<grpc::StatusCode>(response.code()))];
      return false;
    }
    return true;
  };
  v1::StreamRequest open;
  open.set_id("open");
  open.mutable_open_session()->set_model(o.target.model);
  open.mutable_open_session()->set_session_id(id);
  v1::StreamResponse response;
  if (call(open, response)) {
    for (int64_t step = 0; step < o.steps; ++step) {
      v1::StreamRequest append;
      append.set_id(absl::StrCat(step));
      append.mutable_append()->set_session_id(id);
      *append.mutable_append()->mutable_query() =
          RandomTensor({1, o.step_tokens, o.target.embed_dim}, gen);
      const auto sent = Clock::now();
      if (!call(append, response)) break;
      run.step_ms.push_back(Milliseconds(Clock::now() - sent));
    }
    v1::StreamRequest close;
    close.set_id("close");
    close.mutable_close_session()->set_session_id(id);
    call(close, response);
  }
  stream->WritesDone();
  stream->Finish();
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
}

}  // namespace

SessionLoadReport RunSessionLoad(const std::shared_ptr<grpc::Channel>& channel,
                                 const SessionLoadOptions& o, bool stream) {
  auto stub = v1::AttentionService::NewStub(channel);
  std::vector<SessionRun> runs(static_cast<size_t>(o.sessions));
  std::vector<std::thread> threads;
  std::random_device entropy;
  const std::string prefix = absl::StrFormat("load-%08x", entropy());
  const auto start = Clock::now();
  for (int s = 0; s < o.sessions; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937 gen(o.seed + s);
      const std::string id = absl::StrCat(prefix, "-", stream ? "s" : "u", s);
      (stream ? RunStream : RunUnary)(*stub, o, id, gen, runs[s]);
    });
  }
  for (auto& t : threads) t.join();
  SessionLoadReport report;
  report.mode = stream ? "stream" : "unary";
  report.seconds = Milliseconds(Clock::now() - start) / 1e3;
  std::vector<double> all;
  for (const SessionRun& run : runs) {
    all.insert(all.end(), run.step_ms.begin(), run.step_ms.end());
    for (const auto& [code, n] : run.errors) report.errors[code] += n;
  }
  std::sort(all.begin(), all.end());
  report.steps = static_cast<int64_t>(all.size());
  report.tokens = report.steps * o.step_tokens;
  report.p50_ms = Percentile(all, 0.5);
  report.p90_ms = Percentile(all, 0.9);
  report.p99_ms = Percentile(all, 0.99);
  report.max_ms = all.empty() ? 0 : all.back();
  return report;
}

std::string SessionLoadReport::Text() const {
  std::string errors_text;
  for (const auto& [code, n] : errors) absl::StrAppend(&errors_text, " ", code, "=", n);
  return absl::StrFormat(
      "%-6s %lld steps, %lld tokens in %.2f s: %.1f tokens/s; per step p50 %.3f ms, p90 %.3f "
      "ms, p99 %.3f ms, max %.3f ms; errors:%s",
      mode, static_cast<long long>(steps), static_cast<long long>(tokens), seconds,
      seconds > 0 ? tokens / seconds : 0.0, p50_ms, p90_ms, p99_ms, max_ms,
      errors_text.empty() ? " none" : errors_text);
}

std::string SessionLoadReport::Json() const {
  return absl::StrFormat(
      "{\"mode\": \"%s\", \"steps\": %lld, \"tokens\": %lld, \"seconds\": %.4f, "
      "\"tokens_per_s\": %.2f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, "
      "\"max_ms\": %.4f, \"errors\": {%s}}",
      mode, static_cast<long long>(steps), static_cast<long long>(tokens), seconds,
      seconds > 0 ? tokens / seconds : 0.0, p50_ms, p90_ms, p99_ms, max_ms, CountsJson(errors));
}

}  // namespace mha::client
