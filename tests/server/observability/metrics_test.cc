// Metrics (the Prometheus page): series per model version that live as long
// as a holder of that version, requests counted by api and code, unknown
// models under one label, the load gauges.
#include "server/observability/metrics.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
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

}  // namespace
}  // namespace mha::server
