// What `mha_client load` reports: a run's counts and latency percentiles
// (text or JSON), and a concurrency sweep's points as CSV and an SVG chart.
#ifndef MHA_CLIENT_LOAD_REPORT_H_
#define MHA_CLIENT_LOAD_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mha::client {

// What a run measured (a value).
struct LoadReport {
  int64_t requests = 0, tokens = 0;
  // By status code name: a failed call, a message answered with an error,
  // or (--stream) a request lost with its stream, under the stream's status.
  std::map<std::string, int64_t> errors;
  int64_t streams = 0;  // --stream: streams the server ended with OK
  // Closed loop: tries again of calls the server was unavailable for (each
  // after a backoff); a call still failing when the run ends is one error.
  int64_t retries = 0;
  double seconds = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, p999_ms = 0, max_ms = 0;
  // Median of each Attend call's round trip minus its compute (the
  // server's mha-compute-time-us trailer): what the call cost above the
  // engine. 0 when no call reported its compute (--stream).
  double above_compute_p50_ms = 0;
  // The same minus the server's time (mha-server-time-us: from the call's
  // dispatch to its answer): the wire, gRPC in both processes and this
  // client. 0 when no call reported it.
  double above_server_p50_ms = 0;

  double rps() const { return seconds > 0 ? requests / seconds : 0; }
  std::string Text() const;
  std::string Json() const;
};

// One point of a concurrency sweep.
struct SweepPoint {
  int concurrency = 0;
  LoadReport report;
};

// The sweep as CSV (concurrency, rps, p50, p99, errors) and as an SVG chart
// of throughput and p99 latency against concurrency.
std::string SweepCsv(const std::vector<SweepPoint>& points);
std::string SweepSvg(const std::vector<SweepPoint>& points);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_REPORT_H_
