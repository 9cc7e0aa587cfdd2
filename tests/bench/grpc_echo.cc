// grpc_echo: gRPC's own floor on this machine. A generic callback service
// that answers every unary call with the bytes it received (no protobuf, no
// copy: the response is the request's ByteBuffer), and a client that sends
// the same bytes and times the round trips. What HTTP/2 framing, flow
// control and gRPC's threads cost before any code of ours runs.
//
//   grpc_echo --serve 127.0.0.1:PORT [--arg name=value ...]
//   grpc_echo --target 127.0.0.1:PORT --bytes N [--calls 30] [--arg name=value ...]
//
// --arg sets a channel argument on both ends (an integer value), e.g.
// grpc.http2.lookahead_bytes=16777216. The client prints one JSON object:
// the median, p10 and p90 round trip in milliseconds.
//
// Tuned as our own processes run (AMD EPYC VM, 16 MiB each way; 2 MiB):
// - both ends fix glibc's heap thresholds as mha_server and mha_client do
//   (engine/large_buffer.h), unless --heap_thresholds=false. With glibc's
//   defaults each call faults its buffers in afresh: 101-117 ms against
//   12-15;
// - the client's calling thread polls a completion queue of its own, as
//   mha_client's lone slot does, unless --callbacks: 10.4 ms against
//   12.4-15.1 (p90 15-19 against 30-66); 1.2-1.6 against 2.2-3.8 ms.
//
// --hold_us N (client): the server answers each call after N us of work on
// both cores, from a thread of its own, as mha_server's worker answers
// after an engine call: the floor of a call that computes that long (the
// client's p50 still includes the hold; subtract it).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/large_buffer.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, serve, "", "serve the echo on this address");
ABSL_FLAG(std::string, target, "", "call the echo at this address");
ABSL_FLAG(int64_t, bytes, 2 << 20, "bytes each way");
ABSL_FLAG(int, calls, 30, "timed calls (after 3 warm-up calls)");
ABSL_FLAG(std::vector<std::string>, arg, {}, "channel arguments name=value (integers)");
ABSL_FLAG(bool, callbacks, false,
          "client: gRPC's callback threads complete each call (default: the calling thread "
          "polls a completion queue, as mha_client's lone slot and blocking clients do)");
ABSL_FLAG(int64_t, hold_us, 0,
          "client: ask the server to hold each answer for this long, both cores busy");
ABSL_FLAG(bool, heap_thresholds, true,
          "fix glibc's heap thresholds as mha_server does (false: glibc's defaults)");

namespace {

constexpr char kHoldKey[] = "echo-hold-us";

// Keeps `us` microseconds of a core busy, as a computation would.
void BusyFor(int64_t us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

// Runs held answers one at a time on a thread of its own, each after the
// hold's busy work on that thread and on a helper thread (which then
// sleeps, as the server's OpenMP team does). Owns both threads, which run
// until the process ends. Thread-safe.
class Holder {
 public:
  Holder() {
    std::thread([this] { Run(&Holder::TakeAnswer); }).detach();
    std::thread([this] { Run(&Holder::TakeHelp); }).detach();
  }
  void Post(int64_t us, std::function<void()> answer) {
    std::lock_guard<std::mutex> lock(mu_);
    answers_.push_back({us, std::move(answer)});
    cv_.notify_all();
  }

 private:
  struct Held {
    int64_t us;
    std::function<void()> answer;
  };
  void Run(void (Holder::*take)()) {
    while (true) (this->*take)();
  }
  void TakeAnswer() {
    Held held;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !answers_.empty(); });
      held = std::move(answers_.front());
      answers_.pop_front();
      help_us_ = held.us;
      cv_.notify_all();
    }
    BusyFor(held.us);
    held.answer();
  }
  void TakeHelp() {
    int64_t us = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return help_us_ > 0; });
      us = help_us_;
      help_us_ = 0;
    }
    BusyFor(us);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Held> answers_;
  int64_t help_us_ = 0;
};

// Echoes each message back and finishes, after the hold the client asked
// for (echo-hold-us). Not shared between calls.
class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor(Holder& holder, int64_t hold_us) : holder_(holder), hold_us_(hold_us) {
    StartRead(&buffer_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    if (hold_us_ <= 0) return Answer();
    holder_.Post(hold_us_, [this] { Answer(); });
  }
  void OnDone() override { delete this; }

 private:
  void Answer() { StartWriteAndFinish(&buffer_, grpc::WriteOptions(), grpc::Status::OK); }

  Holder& holder_;
  const int64_t hold_us_;
  grpc::ByteBuffer buffer_;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    int64_t hold_us = 0;
    const auto hold = context->client_metadata().find(kHoldKey);
    if (hold != context->client_metadata().end()) {
      (void)absl::SimpleAtoi(absl::string_view(hold->second.data(), hold->second.size()), &hold_us);
    }
    return new EchoReactor(holder_, hold_us);
  }

  Holder holder_;
};

// The --arg values, or exits naming the bad one.
std::vector<std::pair<std::string, int>> ChannelArgs() {
  std::vector<std::pair<std::string, int>> args;
  for (const std::string& a : absl::GetFlag(FLAGS_arg)) {
    std::pair<std::string, std::string> kv = absl::StrSplit(a, absl::MaxSplits('=', 1));
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value)) {
      std::fprintf(stderr, "--arg %s: want name=integer\n", a.c_str());
      std::exit(2);
    }
    args.emplace_back(kv.first, value);
  }
  return args;
}

int Serve(const std::string& address) {
  EchoService service;
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : ChannelArgs()) builder.AddChannelArgument(name, value);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 1;
  std::printf("serving %s\n", address.c_str());
  std::fflush(stdout);
  server->Wait();
  return 0;
}

int Call(const std::string& target) {
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);
  channel_args.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : ChannelArgs()) channel_args.SetInt(name, value);
  auto channel =
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), channel_args);
  grpc::GenericStub stub(channel);
  const std::string bytes(absl::GetFlag(FLAGS_bytes), '\x5a');
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer request(&slice, 1);
  const int calls = absl::GetFlag(FLAGS_calls);
  grpc::CompletionQueue cq;
  std::vector<double> ms;
  for (int i = 0; i < calls + 3; ++i) {
    grpc::ClientContext context;
    if (absl::GetFlag(FLAGS_hold_us) > 0) {
      context.AddMetadata(kHoldKey, std::to_string(absl::GetFlag(FLAGS_hold_us)));
    }
    grpc::ByteBuffer response;
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    grpc::Status status;
    const auto start = std::chrono::steady_clock::now();
    if (!absl::GetFlag(FLAGS_callbacks)) {
      auto call = stub.PrepareUnaryCall(&context, "/echo.Echo/Echo", request, &cq);
      call->StartCall();
      call->Finish(&response, &status, &cq);
      void* tag = nullptr;
      bool ok = false;
      cq.Next(&tag, &ok);
    } else {
      stub.UnaryCall(&context, "/echo.Echo/Echo", grpc::StubOptions(), &request, &response,
                     [&](grpc::Status s) {
                       std::lock_guard<std::mutex> lock(mu);
                       status = std::move(s);
                       done = true;
                       done_cv.notify_one();
                     });
      std::unique_lock<std::mutex> lock(mu);
      done_cv.wait(lock, [&] { return done; });
    }
    const auto took = std::chrono::steady_clock::now() - start;
    if (!status.ok() || response.Length() != bytes.size()) {
      std::fprintf(stderr, "echo failed: %s (%zu bytes back)\n", status.error_message().c_str(),
                   response.Length());
      return 1;
    }
    if (i >= 3) ms.push_back(std::chrono::duration<double, std::milli>(took).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf(
      "{\"bytes\": %zu, \"calls\": %d, \"p50_ms\": %.4f, \"p10_ms\": %.4f, \"p90_ms\": %.4f}\n",
      bytes.size(), calls, ms[ms.size() / 2], ms[ms.size() / 10], ms[ms.size() * 9 / 10]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_heap_thresholds)) mha::SetHeapThresholds();
  if (!absl::GetFlag(FLAGS_serve).empty()) return Serve(absl::GetFlag(FLAGS_serve));
  if (!absl::GetFlag(FLAGS_target).empty()) return Call(absl::GetFlag(FLAGS_target));
  std::fprintf(stderr, "give --serve ADDRESS or --target ADDRESS\n");
  return 2;
}
