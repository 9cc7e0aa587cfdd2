// Metrics (the Prometheus page): series per model version that live as long
// as a holder of that version, requests counted by api and code, unknown
// models under one label, the load gauges.
#include "server/observability/metrics.h"

#include <memory>
#include <regex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace mha::server {
namespace {

std::string Page(const Metrics& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
}

TEST(MetricsTest, AVersionsSeriesLiveWhileItIsHeld) {
  Metrics metrics;
  std::shared_ptr<ModelMetrics> v1 = metrics.ForVersion("enc", "1");
  std::shared_ptr<ModelMetrics> again = metrics.ForVersion("enc", "1");
  EXPECT_EQ(v1.get(), again.get());  // one set of series per version
  v1->CountRequest(kApiMha, absl::StatusCode::kOk);
  v1->CountRequest(kApiKserve, absl::StatusCode::kInvalidArgument);
  v1->CountDropped("queue_full");
  const std::string page = Page(metrics);
  EXPECT_NE(page.find(R"(mha_requests_total{api="mha.v1",code="OK",model="enc",version="1"} 1)"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find(R"(code="INVALID_ARGUMENT",model="enc",version="1"} 1)"), std::string::npos);
  EXPECT_NE(page.find(R"(mha_queue_depth{model="enc",version="1"})"), std::string::npos);
  v1.reset();
  EXPECT_NE(Page(metrics).find(R"(model="enc",version="1")"), std::string::npos)
      << "a holder is left";
  again.reset();
  EXPECT_EQ(Page(metrics).find(R"(model="enc",version="1")"), std::string::npos)
      << "the last holder took the series with it";
}

TEST(MetricsTest, UnknownModelsShareOneLabelAndLoadsAreGauged) {
  Metrics metrics;
  metrics.CountUnknownModelRequest(kApiKserve, absl::StatusCode::kNotFound);
  metrics.CountUnknownModelRequest(kApiKserve, absl::StatusCode::kNotFound);
  metrics.SetLoaded("dec", false);
  metrics.CountLoadFailure("dec");
  const std::string page = Page(metrics);
  EXPECT_NE(page.find(std::string("model=\"") + kUnknownModelLabel + "\",version=\"\"} 2"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find(R"(mha_model_loaded{model="dec"} 0)"), std::string::npos) << page;
  EXPECT_NE(page.find(R"(mha_model_load_failures_total{model="dec"} 1)"), std::string::npos)
      << page;
}

// Every documented series of a model is on the page from its first load, at
// 0, so that alerts (rate(...[5m]) > 0) have something to match.
TEST(MetricsTest, SessionSeriesAreExportedAtZeroFromTheFirstLoad) {
  Metrics metrics;
  metrics.SetLoaded("dec", true);
  const std::string page = Page(metrics);
  for (const char* reason : {"cache_full", "expired", "failed"}) {
    EXPECT_NE(page.find(absl::StrCat("mha_session_evictions_total{model=\"dec\",reason=\"", reason,
                                     "\"} 0")),
              std::string::npos)
        << reason << "\n"
        << page;
  }
  for (const char* reason : {"memory", "deadline", "cancelled"}) {
    EXPECT_NE(page.find(absl::StrCat("mha_session_steps_dropped_total{model=\"dec\",reason=\"",
                                     reason, "\"} 0")),
              std::string::npos)
        << reason;
  }
  EXPECT_NE(page.find(R"(mha_sessions_active{model="dec"} 0)"), std::string::npos);
}

// Bucket bounds print as the decimals they mean: never
// le="0.0006000000000000001" (a product of rounded decades) or
// le="0.0005999999999999999" (0.0006 at prometheus-cpp's 16 digits).
TEST(MetricsTest, HistogramBoundsPrintAsShortDecimals) {
  Metrics metrics;
  metrics.SetLoaded("dec", true);
  std::shared_ptr<ModelMetrics> v1 = metrics.ForVersion("dec", "1");
  const std::string page = Page(metrics);
  const std::regex le("le=\"([^\"]*)\"");
  int bounds = 0;
  for (auto it = std::sregex_iterator(page.begin(), page.end(), le); it != std::sregex_iterator();
       ++it, ++bounds) {
    EXPECT_LE((*it)[1].length(), 7u) << (*it)[0];  // "0.00075", "2.5", "+Inf"
  }
  EXPECT_GT(bounds, 100);
  for (const char* bound : {"le=\"0.0005\"", "le=\"0.00075\"", "le=\"2.5e-05\"", "le=\"10\""}) {
    EXPECT_NE(page.find(bound), std::string::npos) << bound;
  }
}

}  // namespace
}  // namespace mha::server
