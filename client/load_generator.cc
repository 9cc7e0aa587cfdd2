#include "client/load_generator.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client_common.h"

namespace mha::client {
namespace {

// A pool of ready requests, so the loop measures the server, not encoding.
std::vector<v1::AttendRequest> MakePool(const LoadOptions& o) {
  std::mt19937 gen(o.seed);
  std::uniform_int_distribution<int64_t> len(o.min_len, o.max_len);
  std::vector<v1::AttendRequest> pool(64);
  for (v1::AttendRequest& r : pool) {
    r.set_model(o.model);
    *r.mutable_query() = RandomTensor({1, len(gen), o.embed_dim}, gen);
    if (o.kv_len > 0) *r.mutable_key() = RandomTensor({1, o.kv_len, o.embed_dim}, gen);
  }
  return pool;
}

std::string CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                                 "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c <= 16 ? kNames[c] : "UNKNOWN";
}

// Shared state of one run. Calls finish on gRPC's threads.
class LoadRun {
 public:
  LoadRun(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& o)
      : stub_(v1::AttentionService::NewStub(channel)), options_(o), pool_(MakePool(o)) {}

  LoadReport Run() {
    start_ = absl::Now();
    end_ = start_ + options_.duration;
    for (int i = 0; i < options_.concurrency; ++i) Issue(i);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return in_flight_ == 0 && started_all_; });
    report_.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    Summarize();
    return report_;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::AttendResponse response;
    absl::Time sent;
    int64_t tokens = 0;
  };

  // Starts one call unless the run is over.
  void Issue(int64_t index) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      started_all_ = true;
      const bool over = absl::Now() >= end_ ||
                        (options_.max_requests > 0 && issued_ >= options_.max_requests);
      if (over) return;
      ++issued_;
      ++in_flight_;
    }
    auto* call = new Call;
    const v1::AttendRequest& request = pool_[index % pool_.size()];
    call->tokens = request.query().shape(1) + (options_.kv_len > 0 ? options_.kv_len : 0);
    call->sent = absl::Now();
    stub_->async()->Attend(&call->context, &request, &call->response,
                           [this, call, index](grpc::Status status) {
                             Finished(call, status);
                             Issue(index + options_.concurrency);
                             std::lock_guard<std::mutex> lock(mu_);
                             if (--in_flight_ == 0) done_cv_.notify_all();
                           });
  }

  void Finished(Call* call, const grpc::Status& status) {
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - call->sent);
    std::lock_guard<std::mutex> lock(mu_);
    if (status.ok()) {
      latencies_ms_.push_back(ms);
      ++report_.requests;
      report_.tokens += call->tokens;
    } else {
      ++report_.errors[CodeName(status.error_code())];
    }
    delete call;
  }

  void Summarize() {
    std::vector<double>& v = latencies_ms_;
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))]; };
    report_.p50_ms = at(0.5), report_.p90_ms = at(0.9), report_.p99_ms = at(0.99);
    report_.p999_ms = at(0.999), report_.max_ms = v.back();
  }

  std::unique_ptr<v1::AttentionService::Stub> stub_;
  const LoadOptions options_;
  const std::vector<v1::AttendRequest> pool_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  absl::Time start_, end_;
  int64_t issued_ = 0, in_flight_ = 0;
  bool started_all_ = false;
  std::vector<double> latencies_ms_;
  LoadReport report_;
};

}  // namespace

std::string LoadReport::Text() const {
  std::string text = absl::StrFormat(
      "requests %d in %.2f s: %.1f req/s, %.0f tokens/s\n"
      "latency ms: p50 %.3f  p90 %.3f  p99 %.3f  p99.9 %.3f  max %.3f\n",
      requests, seconds, rps(), seconds > 0 ? tokens / seconds : 0, p50_ms, p90_ms, p99_ms,
      p999_ms, max_ms);
  for (const auto& [code, count] : errors) absl::StrAppend(&text, "errors ", code, ": ", count, "\n");
  return text;
}

std::string LoadReport::Json() const {
  std::string errs;
  for (const auto& [code, count] : errors) {
    absl::StrAppend(&errs, errs.empty() ? "" : ", ", "\"", code, "\": ", count);
  }
  return absl::StrFormat(
      "{\"requests\": %d, \"seconds\": %.4f, \"rps\": %.2f, \"tokens_per_s\": %.1f, "
      "\"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, \"p999_ms\": %.4f, "
      "\"max_ms\": %.4f, \"errors\": {%s}}",
      requests, seconds, rps(), seconds > 0 ? tokens / seconds : 0, p50_ms, p90_ms, p99_ms,
      p999_ms, max_ms, errs);
}

LoadReport RunLoad(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& options) {
  LoadRun run(channel, options);
  return run.Run();
}

}  // namespace mha::client
