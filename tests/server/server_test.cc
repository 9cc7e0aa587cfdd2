// Server: the whole object graph built from ServerOptions, started on free
// ports over the repository's demo model, answering, and drained; options
// it cannot serve with are refused with what is wrong.
#include "server/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

ServerOptions DemoOptions() {
  ServerOptions options;
  options.model_repository = MHA_DEMO_REPOSITORY;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = 0;
  options.http_port = 0;  // off (8000 by default)
  options.shutdown_grace = absl::Seconds(5);
  return options;
}

TEST(ServerTest, StartsServesAndDrains) {
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(DemoOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ready = (*server)->ReadyLine();
  std::smatch port;
  ASSERT_TRUE(std::regex_search(ready, port,
                                std::regex("^mha_server ready grpc_port=(\\d+) "
                                           "metrics_port=\\d+ http_port=0 models=demo ")))
      << ready;
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + port[1].str(), grpc::InsecureChannelCredentials()));
  auto list = [&](v1::ListModelsResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub->ListModels(&context, v1::ListModelsRequest(), response);
  };
  v1::ListModelsResponse models;
  const grpc::Status listed = list(&models);
  ASSERT_TRUE(listed.ok()) << listed.error_message();
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).name(), "demo");
  EXPECT_EQ(models.models(0).state(), v1::ModelInfo::STATE_READY);

  (*server)->Drain();
  EXPECT_FALSE(list(&models).ok()) << "a drained server serves nothing";
  (*server)->Drain();  // once is enough; again does nothing
}

// Binds and listens on a free loopback port, so that a server started on it
// finds it taken. The caller closes *fd.
void HoldLoopbackPort(int* fd, int* port) {
  *fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(*fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(bind(*fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(*fd, 1), 0);
  ASSERT_EQ(getsockname(*fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  *port = ntohs(address.sin_port);
}

TEST(ServerTest, RefusesOptionsItCannotServeWith) {
  ServerOptions tiny = DemoOptions();
  tiny.memory_limit_bytes = int64_t{1} << 20;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(tiny);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("--memory_limit_bytes 1,048,576 leaves nothing for requests"));

  ServerOptions mode = DemoOptions();
  mode.model_control_mode = "sometimes";
  EXPECT_EQ(Server::Start(mode).status().code(), absl::StatusCode::kInvalidArgument);

  // A metrics port another socket holds: a precise error, not an abort.
  int held = -1;
  ServerOptions metrics = DemoOptions();
  HoldLoopbackPort(&held, &metrics.metrics_port);
  server = Server::Start(metrics);
  close(held);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr(absl::StrCat("--metrics_port: cannot serve /metrics on 127.0.0.1:",
                                     metrics.metrics_port, " (in use?)")));

  // The same for the HTTP port.
  ServerOptions http = DemoOptions();
  HoldLoopbackPort(&held, &http.http_port);
  server = Server::Start(http);
  close(held);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(
      std::string(server.status().message()),
      HasSubstr(absl::StrCat("--http_port: cannot serve HTTP on 127.0.0.1:", http.http_port)));

  // The gRPC port of a server that is running: gRPC would share it
  // (SO_REUSEPORT) and split the clients between two servers.
  absl::StatusOr<std::unique_ptr<Server>> first = Server::Start(DemoOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  std::smatch port;
  const std::string ready = (*first)->ReadyLine();
  ASSERT_TRUE(std::regex_search(ready, port, std::regex("grpc_port=(\\d+)"))) << ready;
  ServerOptions same_port = DemoOptions();
  same_port.port = std::stoi(port[1].str());
  server = Server::Start(same_port);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr(absl::StrCat("--port: cannot serve gRPC on 127.0.0.1:", same_port.port,
                                     " (in use?)")));
  (*first)->Drain();

  ServerOptions tls = DemoOptions();
  tls.tls_cert = "/nonexistent/cert.pem";
  server = Server::Start(tls);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("--tls_cert and --tls_key"));
}

}  // namespace
}  // namespace mha::server
