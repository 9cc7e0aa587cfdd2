#include "client/load_command.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/client_common.h"
#include "client/load_generator.h"
#include "client/session_load.h"

namespace mha::client {
namespace {

// Model `name` and its widths, as the server describes it.
grpc::Status FindTarget(v1::AttentionService::Stub& stub, const std::string& name,
                        const ContextFactory& context, LoadTarget& target) {
  v1::GetModelRequest get;
  get.set_name(name);
  v1::ModelInfo info;
  const grpc::Status status = stub.GetModel(context().get(), get, &info);
  if (status.ok()) target = {info.name(), info.embed_dim(), info.kdim(), info.max_message_bytes()};
  return status;
}

int LoadSessions(const std::shared_ptr<grpc::Channel>& channel, const LoadCommand& c,
                 const ContextFactory& context) {
  SessionLoadOptions o;
  o.sessions = c.sessions;
  o.steps = std::max<int64_t>(1, c.steps);
  o.step_tokens = std::max<int64_t>(1, c.step_tokens);
  o.seed = c.seed;
  o.token = c.token;
  auto stub = v1::AttentionService::NewStub(channel);
  if (const grpc::Status status = FindTarget(*stub, c.models, context, o.target); !status.ok()) {
    return ReportError(status);
  }
  bool failed = false;
  for (const bool stream : {false, true}) {
    const SessionLoadReport report = RunSessionLoad(channel, o, stream);
    std::printf("%s\n", c.json ? report.Json().c_str() : report.Text().c_str());
    failed = failed || !report.errors.empty();
  }
  return failed ? 1 : 0;
}

// The query lengths of `load`: --len_range MIN:MAX, or --len L (one of
// the two). False (the reason printed) when they are not lengths.
bool LengthsOf(const LoadCommand& c, LoadOptions& o) {
  const bool len_given = c.len_given;
  if (len_given && c.len_range_given) {
    std::fprintf(stderr, "load: give --len or --len_range, not both\n");
    return false;
  }
  if (len_given) {
    o.min_len = o.max_len = c.len;
    if (o.min_len >= 1) return true;
    std::fprintf(stderr, "--len: at least 1, got %lld\n", static_cast<long long>(o.min_len));
    return false;
  }
  const std::vector<std::string> range = absl::StrSplit(c.len_range, ':');
  if (range.size() != 2 || !absl::SimpleAtoi(range[0], &o.min_len) ||
      !absl::SimpleAtoi(range[1], &o.max_len) || o.min_len < 1 || o.max_len < o.min_len) {
    std::fprintf(stderr, "--len_range: expected MIN:MAX (1 <= MIN <= MAX), got %s\n",
                 c.len_range.c_str());
    return false;
  }
  return true;
}

int Sweep(const std::shared_ptr<grpc::Channel>& channel, const LoadCommand& c, LoadOptions o) {
  std::vector<SweepPoint> points;
  for (absl::string_view c : absl::StrSplit(c.sweep, ',')) {
    SweepPoint point;
    if (!absl::SimpleAtoi(c, &point.concurrency) || point.concurrency < 1) {
      std::fprintf(stderr, "--sweep: expected positive integers, got '%s'\n",
                   std::string(c).c_str());
      return 2;
    }
    o.concurrency = point.concurrency;
    o.rate = 0;
    point.report = RunLoad(channel, o);
    std::printf("concurrency %4d: %9.1f req/s  p50 %8.3f ms  p99 %8.3f ms\n", point.concurrency,
                point.report.rps(), point.report.p50_ms, point.report.p99_ms);
    points.push_back(point);
  }
  const std::string prefix = c.sweep_out;
  for (const auto& [suffix, text] :
       {std::pair{".csv", SweepCsv(points)}, std::pair{".svg", SweepSvg(points)}}) {
    std::ofstream file(prefix + suffix);
    file << text;
    if (!file) {
      std::fprintf(stderr, "cannot write %s%s\n", prefix.c_str(), suffix);
      return 1;
    }
  }
  std::printf("wrote %s.csv and %s.svg\n", prefix.c_str(), prefix.c_str());
  return 0;
}

}  // namespace

int RunLoadCommand(const std::shared_ptr<grpc::Channel>& channel, const LoadCommand& c,
                   const ContextFactory& context) {
  if (c.sessions > 0) return LoadSessions(channel, c, context);
  LoadOptions o;
  o.concurrency = c.concurrency;
  if (o.concurrency < 1) {
    std::fprintf(stderr, "--concurrency: expected at least 1, got %d\n", o.concurrency);
    return 2;
  }
  if (c.rate < 0) {
    std::fprintf(stderr, "--rate: expected a rate >= 0 (0: as fast as --concurrency allows)\n");
    return 2;
  }
  o.stream = c.stream;
  if (o.stream && c.rate > 0) {
    std::fprintf(stderr, "--stream: a closed loop only (drop --rate)\n");
    return 2;
  }
  o.duration = c.duration;
  o.max_requests = c.requests;
  o.warmup_requests = c.warmup_requests;
  if (o.warmup_requests < 0) {
    std::fprintf(stderr, "--warmup_requests: expected at least 0, got %lld\n",
                 static_cast<long long>(o.warmup_requests));
    return 2;
  }
  o.kv_len = c.kv_len;
  o.batch = c.batch;
  if (o.batch < 1) {
    std::fprintf(stderr, "--batch: at least 1, got %lld\n", static_cast<long long>(o.batch));
    return 2;
  }
  o.seed = c.seed;
  o.dtype = c.dtype;
  o.token = c.token;
  if (!LengthsOf(c, o)) return 2;
  if (const absl::Status s = CheckShapeFlags(o.batch, o.min_len, o.kv_len); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  auto stub = v1::AttentionService::NewStub(channel);
  o.models.clear();
  for (absl::string_view name : absl::StrSplit(c.models, ',')) {
    const grpc::Status status =
        FindTarget(*stub, std::string(name), context, o.models.emplace_back());
    if (!status.ok()) return ReportError(status);
  }
  for (const LoadTarget& target : o.models) {  // the longest request of the pool
    const double element_bytes = o.dtype == v1::DATA_TYPE_FP32 ? 4.0 : 2.0;
    const double bytes = element_bytes * o.batch *
                         (double(o.max_len) * target.embed_dim + double(o.kv_len) * target.kdim);
    const absl::Status fits =
        CheckRequestBytes(bytes, c.max_message_bytes, target.max_message_bytes,
                          "send fewer tokens (--batch, --len_range)");
    if (!fits.ok()) {
      std::fprintf(stderr, "%s\n", std::string(fits.message()).c_str());
      return 2;
    }
  }
  o.rate = c.rate;
  o.progress = isatty(STDERR_FILENO) && !c.json;
  if (!c.sweep.empty()) return Sweep(channel, c, o);
  const LoadReport report = RunLoad(channel, o);
  std::printf("%s\n", c.json ? report.Json().c_str() : report.Text().c_str());
  return report.errors.empty() ? 0 : 1;
}

}  // namespace mha::client
