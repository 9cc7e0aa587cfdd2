// Triton's HTTP infer body to KServe's message and back, and the body
// decompression of the HTTP server: what each accepts, and the precise
// refusals of what it does not.
#include "server/frontends/kserve_http/http_infer_codec.h"

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/frontends/kserve_http/http_server.h"

namespace mha::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

TEST(HttpInferCodecTest, NestedAndFlatJsonDataBecomeTheSameRawBytes) {
  for (const char* data : {R"([[[1, 2.5], [-3, 4]]])", R"([1, 2.5, -3, 4])"}) {
    const std::string body = std::string(R"({"id": "a", "inputs": [{"name": "query",)") +
                             R"( "datatype": "FP32", "shape": [1, 2, 2], "data": )" + data +
                             R"(}, {"name": "key_padding_mask", "datatype": "BOOL",)" +
                             R"( "shape": [1, 2], "data": [true, false]}],)" +
                             R"( "parameters": {"need_weights": true, "timeout": 5}})";
    absl::StatusOr<HttpInferRequest> decoded = DecodeHttpInfer(body, std::nullopt, "demo", "");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    const inference::ModelInferRequest& m = decoded->message;
    EXPECT_EQ(m.model_name(), "demo");
    EXPECT_EQ(m.id(), "a");
    ASSERT_EQ(m.raw_input_contents_size(), 2);
    EXPECT_EQ(m.raw_input_contents(0), FloatBytes({1, 2.5, -3, 4}));
    EXPECT_EQ(m.raw_input_contents(1), std::string("\x01\x00", 2));
    EXPECT_TRUE(m.parameters().at("need_weights").bool_param());
    EXPECT_EQ(m.parameters().at("timeout").int64_param(), 5);
  }
}

TEST(HttpInferCodecTest, BinaryInputsAreCutFromTheBodyInOrder) {
  const std::string header =
      R"({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 1, 2],)"
      R"( "parameters": {"binary_data_size": 8}}, {"name": "key", "datatype": "FP32",)"
      R"( "shape": [1, 1, 1], "data": [7]}, {"name": "value", "datatype": "FP32",)"
      R"( "shape": [1, 1, 1], "parameters": {"binary_data_size": 4}}],)"
      R"( "outputs": [{"name": "output", "parameters": {"binary_data": true}}]})";
  const std::string body = header + FloatBytes({1, 2}) + FloatBytes({3});
  absl::StatusOr<HttpInferRequest> decoded = DecodeHttpInfer(body, header.size(), "demo", "1");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  // The binary inputs stay in the body (held once), the JSON one is decoded.
  ASSERT_EQ(decoded->in_body.size(), 3u);
  ASSERT_EQ(decoded->in_body[0].size(), 1u);
  EXPECT_EQ(reinterpret_cast<const char*>(decoded->in_body[0][0].data()),
            body.data() + header.size());
  EXPECT_EQ(decoded->in_body[0][0].size(), 8u);
  EXPECT_TRUE(decoded->in_body[1].empty());
  EXPECT_EQ(decoded->message.raw_input_contents(0), "");
  decoded->Materialize();
  const inference::ModelInferRequest& m = decoded->message;
  ASSERT_EQ(m.raw_input_contents_size(), 3);
  EXPECT_EQ(m.raw_input_contents(0), FloatBytes({1, 2}));
  EXPECT_EQ(m.raw_input_contents(1), FloatBytes({7}));
  EXPECT_EQ(m.raw_input_contents(2), FloatBytes({3}));
  EXPECT_FALSE(m.inputs(0).parameters().contains("binary_data_size")) << "HTTP only";
  EXPECT_FALSE(m.outputs(0).parameters().contains("binary_data")) << "HTTP only";
  EXPECT_TRUE(decoded->Binary("output"));
  EXPECT_FALSE(decoded->Binary("attn_weights"));
}

TEST(HttpInferCodecTest, RawBodyIsOneFp32QueryAnsweredInBinary) {
  const std::vector<float> rows = {1, 2, 3, 4, 5, 6};  // L = 2 rows of E = 3
  const std::string body(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(float));
  absl::StatusOr<HttpInferRequest> decoded = DecodeHttpInfer(body, 0, "m", "2", 3);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  decoded->Materialize();
  const inference::ModelInferRequest& m = decoded->message;
  EXPECT_EQ(m.model_version(), "2");
  ASSERT_EQ(m.inputs_size(), 1);
  EXPECT_EQ(m.inputs(0).name(), "query");
  EXPECT_EQ(m.inputs(0).datatype(), "FP32");
  EXPECT_THAT(m.inputs(0).shape(), ElementsAre(1, 2, 3));
  EXPECT_EQ(m.raw_input_contents(0), body);
  EXPECT_TRUE(decoded->Binary("output"));
  EXPECT_TRUE(decoded->Binary("attn_weights"));
  for (const size_t bytes : {size_t{0}, size_t{4}, size_t{13}}) {
    absl::StatusOr<HttpInferRequest> bad = DecodeHttpInfer(body.substr(0, bytes), 0, "m", "", 3);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("a multiple of 12 bytes"));
  }
}

TEST(HttpInferCodecTest, RefusalsNameWhatIsWrong) {
  const std::string q = R"({"name": "query", "datatype": "FP32", "shape": [1, 1, 2])";
  const struct {
    std::string body;
    std::optional<size_t> header_length;
    const char* words;
  } cases[] = {
      {"{" + q + R"(, "data": [1]}]})", std::nullopt, "not JSON"},
      {R"({"inputs": [)" + q + R"(, "data": [1]}]})", std::nullopt, "has 2 elements but"},
      {R"({"inputs": [)" + q + R"(, "data": [1, "a"]}]})", std::nullopt, "non-number"},
      {R"({"inputs": [)" + q + R"(}]})", std::nullopt, "no data"},
      {R"({"inputs": [{"name": "query", "datatype": "BF16", "shape": [1], "data": [1]}]})",
       std::nullopt, "only as binary data"},
      {R"({"inputs": [{"name": "query", "datatype": "FP32", "shape": [-1], "data": []}]})",
       std::nullopt, "non-negative"},
      {R"({"inputs": [)" + q + R"(, "parameters": {"binary_data_size": 9}}]})" + "12345678",
       std::nullopt, "not JSON"},
      {std::string(100, '['), std::nullopt, "deeper than"},
      {R"({"inputs": []})", 100, "larger than the body"},
      {R"({"inputs": []})", 0, "Inference-Header-Content-Length 0"},
      {R"({"inputs": []}xx)", 14, "2 bytes of binary data follow"},
      {R"({"inputs": {}})", std::nullopt, "\"inputs\" array"},
      {R"({"inputs": [], "parameters": {"p": [1]}})", std::nullopt, "parameter \"p\""},
      {R"({"inputs": [], "outputs": [{"name": "o", "parameters": {"binary_data": 1}}]})",
       std::nullopt, "binary_data must be a bool"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.body.substr(0, 80));
    absl::StatusOr<HttpInferRequest> decoded = DecodeHttpInfer(c.body, c.header_length, "m", "");
    ASSERT_FALSE(decoded.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(decoded.status())) << decoded.status();
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(c.words));
  }
  // A binary_data_size that runs past the body, with the header length.
  const std::string header =
      R"({"inputs": [)" + q + R"(, "parameters": {"binary_data_size": 9}}]})";
  absl::StatusOr<HttpInferRequest> past = DecodeHttpInfer(header + "1234", header.size(), "m", "");
  ASSERT_FALSE(past.ok());
  EXPECT_THAT(std::string(past.status().message()), HasSubstr("runs past the end"));
}

TEST(HttpInferCodecTest, ResponsesAreJsonOrJsonFollowedByBinary) {
  inference::ModelInferResponse response;
  response.set_model_name("demo");
  response.set_model_version("1");
  response.set_id("x");
  auto* out = response.add_outputs();
  out->set_name("output");
  out->set_datatype("FP32");
  out->add_shape(1);
  out->add_shape(2);
  response.add_raw_output_contents(FloatBytes({0.5f, -2}));
  HttpInferRequest as_json;
  absl::StatusOr<HttpInferBody> body = EncodeHttpInfer(response, as_json);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_FALSE(body->header_length.has_value());
  const nlohmann::json parsed = nlohmann::json::parse(body->body);
  EXPECT_EQ(parsed["id"], "x");
  EXPECT_EQ(parsed["model_version"], "1");
  EXPECT_EQ(parsed["outputs"][0]["data"], nlohmann::json({0.5, -2.0}));

  HttpInferRequest as_binary;
  as_binary.outputs.emplace_back("output", true);
  body = EncodeHttpInfer(response, as_binary);
  ASSERT_TRUE(body.ok()) << body.status();
  ASSERT_TRUE(body->header_length.has_value());
  EXPECT_EQ(*body->header_length, body->body.size());  // the binary outputs follow apart
  const nlohmann::json header = nlohmann::json::parse(body->body);
  EXPECT_EQ(header["outputs"][0]["parameters"]["binary_data_size"], 8);
  EXPECT_FALSE(header["outputs"][0].contains("data"));
  ASSERT_EQ(body->binary.size(), 1u);
  EXPECT_EQ(body->binary[0].bytes(), FloatBytes({0.5f, -2}));
  response.set_raw_output_contents(0, FloatBytes({0.5f, -2}));  // moved out

  // An output left where the engine wrote it (a view its owner keeps
  // alive) is sent from there as binary, and read from there as JSON.
  auto engine_output = std::make_shared<std::vector<float>>(std::vector<float>{1.5f, 4});
  response.set_raw_output_contents(0, "");
  const DeferredOutput view{0, *engine_output, DType::kF32, engine_output, {}};
  body = EncodeHttpInfer(response, as_binary, {&view, 1});
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(nlohmann::json::parse(body->body)["outputs"][0]["parameters"]["binary_data_size"], 8);
  ASSERT_EQ(body->binary.size(), 1u);
  EXPECT_EQ(body->binary[0].bytes().data(), reinterpret_cast<const char*>(engine_output->data()));
  EXPECT_EQ(body->binary[0].bytes().size(), 8u);
  EXPECT_EQ(engine_output.use_count(), 3);  // held by the part to send, beside the view
  body = EncodeHttpInfer(response, as_json, {&view, 1});
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(nlohmann::json::parse(body->body)["outputs"][0]["data"], nlohmann::json({1.5, 4.0}));
  response.set_raw_output_contents(0, FloatBytes({0.5f, -2}));

  // Floats as text read back to the same float; JSON has no NaN: null.
  const std::vector<float> values = {0.1f,  3.4028235e38f, 1e-45f,
                                     -0.0f, 123456.79f,    std::numeric_limits<float>::quiet_NaN()};
  out->clear_shape();
  out->add_shape(static_cast<int64_t>(values.size()));
  response.set_raw_output_contents(0, FloatBytes(values));
  body = EncodeHttpInfer(response, as_json);
  ASSERT_TRUE(body.ok()) << body.status();
  const nlohmann::json data = nlohmann::json::parse(body->body)["outputs"][0]["data"];
  ASSERT_EQ(data.size(), values.size());
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    EXPECT_EQ(static_cast<float>(data[i].get<double>()), values[i]) << data[i];
  }
  EXPECT_TRUE(data.back().is_null());
  EXPECT_THAT(body->body, HasSubstr("[0.1,3.4028235e+38,1e-45,-0,123456.79,null]"));

  out->set_datatype("BF16");
  body = EncodeHttpInfer(response, as_json);
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(std::string(body.status().message()), HasSubstr("only as binary data"));
}

TEST(HttpInferCodecTest, MessagesBecomeJsonWithEveryFieldAndNumbers) {
  inference::ModelStatisticsResponse stats;
  auto* model = stats.add_model_stats();
  model->set_name("demo");
  model->set_inference_count(uint64_t{1} << 40);
  const nlohmann::json j = MessageToJson(stats);
  EXPECT_EQ(j["model_stats"][0]["inference_count"], uint64_t{1} << 40);
  EXPECT_EQ(j["model_stats"][0]["execution_count"], 0) << "defaults are printed";
  EXPECT_EQ(j["model_stats"][0]["inference_stats"]["success"]["ns"], 0);
  EXPECT_TRUE(j["model_stats"][0]["batch_stats"].is_array());
}

TEST(HttpBodyTest, GzipAndDeflateDecodeWithinTheLimit) {
  const std::string text(100000, 'a');
  absl::StatusOr<std::string> plain = DecodeContent("gzip", GzipOf(text), text.size());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(*plain, text);
  absl::StatusOr<std::string> bomb = DecodeContent("gzip", GzipOf(text), text.size() - 1);
  EXPECT_TRUE(absl::IsResourceExhausted(bomb.status())) << bomb.status();
  EXPECT_THAT(std::string(bomb.status().message()), HasSubstr("once decompressed"));
  std::string cut = GzipOf(text);
  cut.resize(cut.size() / 2);
  EXPECT_THAT(std::string(DecodeContent("gzip", cut, text.size()).status().message()),
              HasSubstr("truncated"));
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeContent("br", "x", 10).status()));
  EXPECT_EQ(*DecodeContent("identity", "abc", 10), "abc");
}

}  // namespace
}  // namespace mha::server
