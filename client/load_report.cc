#include "client/load_report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client_common.h"

namespace mha::client {

std::string LoadReport::Text() const {
  std::string text = absl::StrFormat(
      "requests %d in %.2f s: %.1f req/s, %.0f tokens/s\n"
      "latency ms: p50 %.3f  p90 %.3f  p99 %.3f  p99.9 %.3f  max %.3f\n",
      requests, seconds, rps(), seconds > 0 ? tokens / seconds : 0, p50_ms, p90_ms, p99_ms, p999_ms,
      max_ms);
  for (const auto& [code, count] : errors)
    absl::StrAppend(&text, "errors ", code, ": ", count, "\n");
  if (retries > 0) {
    absl::StrAppend(&text, "retries while the server was unavailable: ", retries, "\n");
  }
  if (streams > 0) absl::StrAppend(&text, "streams ended OK: ", streams, "\n");
  return text;
}

std::string LoadReport::Json() const {
  return absl::StrFormat(
      "{\"requests\": %d, \"tokens\": %d, \"seconds\": %.4f, \"rps\": %.2f, "
      "\"tokens_per_s\": %.1f, "
      "\"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, \"p999_ms\": %.4f, "
      "\"max_ms\": %.4f, \"above_compute_p50_ms\": %.4f, \"above_server_p50_ms\": %.4f, "
      "\"errors\": {%s}, \"retries\": %d, "
      "\"streams\": %d}",
      requests, tokens, seconds, rps(), seconds > 0 ? tokens / seconds : 0, p50_ms, p90_ms, p99_ms,
      p999_ms, max_ms, above_compute_p50_ms, above_server_p50_ms, CountsJson(errors), retries,
      streams);
}

std::string SweepCsv(const std::vector<SweepPoint>& points) {
  std::string csv = "concurrency,rps,p50_ms,p99_ms,errors\n";
  for (const SweepPoint& p : points) {
    int64_t errors = 0;
    for (const auto& [code, n] : p.report.errors) errors += n;
    absl::StrAppendFormat(&csv, "%d,%.2f,%.4f,%.4f,%d\n", p.concurrency, p.report.rps(),
                          p.report.p50_ms, p.report.p99_ms, errors);
  }
  return csv;
}

// Two panels side by side: req/s and p99 ms against concurrency (log2 x).
std::string SweepSvg(const std::vector<SweepPoint>& points) {
  constexpr double kW = 360, kH = 240, kPad = 48;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n",
      static_cast<int>(2 * kW), static_cast<int>(kH));
  const auto panel = [&](int index, const char* title, const char* color, auto value) {
    double max_y = 0, max_x = 1;
    for (const SweepPoint& p : points) {
      max_y = std::max(max_y, value(p));
      max_x = std::max(max_x, std::log2(std::max(1, p.concurrency)));
    }
    if (max_y <= 0) max_y = 1;
    const double x0 = index * kW + kPad, y0 = kH - kPad, w = kW - 1.5 * kPad, h = kH - 2 * kPad;
    absl::StrAppendFormat(
        &svg,
        "<text x=\"%.0f\" y=\"20\">%s</text>\n"
        "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n"
        "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n"
        "<text x=\"%.0f\" y=\"%.0f\">%.4g</text>\n",
        x0, title, x0, y0, x0 + w, y0, x0, y0, x0, y0 - h, x0 - kPad + 4, y0 - h + 4, max_y);
    std::string line;
    for (const SweepPoint& p : points) {
      const double x = x0 + w * std::log2(std::max(1, p.concurrency)) / max_x;
      const double y = y0 - h * value(p) / max_y;
      absl::StrAppendFormat(&line, "%.1f,%.1f ", x, y);
      absl::StrAppendFormat(&svg,
                            "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n"
                            "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%d</text>\n",
                            x, y, color, x, y0 + 14, p.concurrency);
    }
    absl::StrAppendFormat(&svg, "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\"/>\n", line,
                          color);
  };
  panel(0, "throughput (req/s) vs concurrency", "steelblue",
        [](const SweepPoint& p) { return p.report.rps(); });
  panel(1, "p99 latency (ms) vs concurrency", "firebrick",
        [](const SweepPoint& p) { return p.report.p99_ms; });
  svg += "</svg>\n";
  return svg;
}

}  // namespace mha::client
