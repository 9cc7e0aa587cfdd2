// HTTP/1.1 on libmicrohttpd: the connections (keep-alive, chunked bodies,
// Expect: 100-continue, TLS), the limits (header bytes, body bytes after
// decompression, idle and slow clients) and the hand-off of each whole
// request to a handler, which answers it once, at once or later from any
// thread. No thread per connection: an epoll loop per thread of a small
// pool, and a request waiting for its answer holds no thread. Nothing here
// knows KServe (http_routes.h does).
#ifndef MHA_SERVER_FRONTENDS_HTTP_SERVER_H_
#define MHA_SERVER_FRONTENDS_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/frontends/kserve_http/http_bytes.h"

struct MHD_Daemon;

namespace mha::server {

// One whole request: the body is decompressed (Content-Encoding gzip or
// deflate) and complete; header names are lower case.
struct HttpRequest {
  std::string method;
  std::string path;  // without the query string, %-escapes decoded
  absl::flat_hash_map<std::string, std::string> headers;
  std::string body;

  // The header's value, or "" when absent.
  absl::string_view Header(absl::string_view lower_case_name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // besides Content-Type
  std::string body;
  // Sent after `body`, each from its own buffer (no joined copy): a
  // response's binary tensors (views of an engine call's outputs among them).
  std::vector<HttpBytes> tail;
};

// Answers a request: exactly once, from any thread.
using HttpRespond = std::function<void(HttpResponse)>;

// What serves the requests. Handle runs on an HTTP thread and must not
// block (a long answer goes through `respond` later). Thread-safe.
class HttpHandler {
 public:
  virtual ~HttpHandler() = default;
  virtual void Handle(const HttpRequest& request, HttpRespond respond) = 0;
};

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;  // 0: a free one
  int threads = 2;  // each an epoll loop over its share of the connections
  int max_connections = 4096;
  size_t max_body_bytes = 64 << 20;    // after decompression too; above: 413
  size_t max_header_bytes = 64 << 10;  // request line and headers; above: 431
  // A connection that sends nothing for this long (an idle keep-alive one,
  // or a client slow to send its headers or body) is closed.
  absl::Duration idle_timeout = absl::Seconds(60);
  std::string tls_cert_pem, tls_key_pem;  // both set: HTTPS only
  // Set (with the two above): every request needs a client certificate
  // this CA signed (mutual TLS, as --tls_client_ca for gRPC).
  std::string tls_client_ca_pem;
  std::string cors_origin;  // set: CORS headers and preflight answers
};

// Owns the libmicrohttpd daemon and its threads; borrows the handler, which
// must outlive Stop. Thread-safe.
class HttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           HttpHandler& handler);
  ~HttpServer();  // Stop()

  int port() const { return port_; }
  // New connections are refused from now on; open ones are served.
  void StopAccepting();
  // Waits up to `grace` for the requests handed to the handler to be
  // answered, then closes every connection and stops the threads. The
  // handler must answer every request eventually (a suspended connection
  // cannot be closed before its answer).
  void Stop(absl::Duration grace = absl::Seconds(30));

  struct Connection;  // one request's state (http_server.cc)

 private:
  friend class HttpServerCallbacks;
  HttpServer(HttpServerOptions options, HttpHandler& handler)
      : options_(std::move(options)), handler_(handler) {}

  const HttpServerOptions options_;
  HttpHandler& handler_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  struct InFlight;
  std::shared_ptr<InFlight> in_flight_;
};

// Body decoding of Content-Encoding `encoding` ("", identity, gzip,
// deflate): the decoded bytes, at most `max_bytes` (else
// RESOURCE_EXHAUSTED), or INVALID_ARGUMENT for a broken stream or an
// unknown encoding (UNIMPLEMENTED).
absl::StatusOr<std::string> DecodeContent(absl::string_view encoding, std::string body,
                                          size_t max_bytes);
// gzip of `data` (for Accept-Encoding: gzip).
std::string GzipOf(absl::string_view data);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_HTTP_SERVER_H_
