#include "server/frontends/kserve_http/http_server.h"

#include <arpa/inet.h>
#include <gnutls/gnutls.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <zlib.h>

#include <cctype>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/mutex.h"
#include "engine/too_large.h"
#include "nlohmann/json.hpp"

namespace mha::server {

absl::string_view HttpRequest::Header(absl::string_view lower_case_name) const {
  auto it = headers.find(lower_case_name);
  return it == headers.end() ? absl::string_view() : absl::string_view(it->second);
}

// Requests handed to the handler and not yet completed (answer sent, or
// connection gone).
struct HttpServer::InFlight {
  Mutex mu;
  int count ABSL_GUARDED_BY(mu) = 0;
  CondVar done;
};

// One request on a connection, from its headers to the answer's last byte.
// Shared by libmicrohttpd's per-request slot and the handler's answer.
struct HttpServer::Connection {
  Connection(HttpServer& s, MHD_Connection* c) : server(s), mhd(c) {}
  HttpServer& server;
  MHD_Connection* const mhd;
  HttpRequest request;
  Mutex mu;
  bool handed_over ABSL_GUARDED_BY(mu) = false;  // given to the handler
  bool answered ABSL_GUARDED_BY(mu) = false;
  bool suspended ABSL_GUARDED_BY(mu) = false;  // waiting for its answer
  HttpResponse response;                       // its body is sent from here (kept until completed)
};

namespace {

using Connection = HttpServer::Connection;

HttpResponse ErrorResponse(int status, absl::string_view message) {
  HttpResponse r;
  r.status = status;
  r.body = nlohmann::json{{"error", std::string(message)}}.dump();
  return r;
}

MHD_Result CollectHeader(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto& headers = *static_cast<absl::flat_hash_map<std::string, std::string>*>(cls);
  std::string name = absl::AsciiStrToLower(key);
  auto [it, inserted] = headers.try_emplace(std::move(name), value == nullptr ? "" : value);
  if (!inserted) absl::StrAppend(&it->second, ", ", value == nullptr ? "" : value);
  return MHD_YES;
}

// Queues `response` (whose body `connection` keeps until completed).
MHD_Result Queue(Connection& connection, const std::string& cors_origin) {
  HttpResponse& r = connection.response;
  MHD_Response* out = nullptr;
  if (r.tail.empty()) {
    out = MHD_create_response_from_buffer(r.body.size(), r.body.data(), MHD_RESPMEM_PERSISTENT);
  } else {  // written from each buffer in turn (libmicrohttpd copies the vector, not the bytes)
    std::vector<MHD_IoVec> pieces = {{r.body.data(), r.body.size()}};
    for (const HttpBytes& part : r.tail)
      pieces.push_back({part.bytes().data(), part.bytes().size()});
    out = MHD_create_response_from_iovec(pieces.data(), static_cast<unsigned>(pieces.size()),
                                         nullptr, nullptr);
  }
  if (out == nullptr) return MHD_NO;
  MHD_add_response_header(out, "Content-Type", r.content_type.c_str());
  for (const auto& [name, value] : r.headers) {
    MHD_add_response_header(out, name.c_str(), value.c_str());
  }
  if (!cors_origin.empty()) {
    MHD_add_response_header(out, "Access-Control-Allow-Origin", cors_origin.c_str());
    MHD_add_response_header(out, "Access-Control-Expose-Headers",
                            "Inference-Header-Content-Length, Content-Encoding");
    MHD_add_response_header(out, "Vary", "Origin");
  }
  const MHD_Result queued = MHD_queue_response(connection.mhd, r.status, out);
  MHD_destroy_response(out);
  return queued;
}

// Mutual TLS: whether the connection's peer sent a certificate that the
// trusted CA signed and that is valid now.
bool ClientCertificateVerified(MHD_Connection* mhd) {
  const MHD_ConnectionInfo* info = MHD_get_connection_info(mhd, MHD_CONNECTION_INFO_GNUTLS_SESSION);
  if (info == nullptr || info->tls_session == nullptr) return false;
  auto session = static_cast<gnutls_session_t>(info->tls_session);
  unsigned int listed = 0;
  if (gnutls_certificate_get_peers(session, &listed) == nullptr || listed == 0) return false;
  unsigned int status = 0;
  return gnutls_certificate_verify_peers2(session, &status) == GNUTLS_E_SUCCESS && status == 0;
}

// An answer the server gives itself, before the handler sees the request.
MHD_Result Refuse(Connection& connection, int status, absl::string_view message,
                  const std::string& cors_origin) {
  connection.response = ErrorResponse(status, message);
  return Queue(connection, cors_origin);
}

}  // namespace

class HttpServerCallbacks {
 public:
  static MHD_Result OnRequest(void* cls, MHD_Connection* mhd, const char* url, const char* method,
                              const char*, const char* upload_data, size_t* upload_data_size,
                              void** slot) {
    HttpServer& server = *static_cast<HttpServer*>(cls);
    auto* held = static_cast<std::shared_ptr<Connection>*>(*slot);
    if (held == nullptr) return OnHeaders(server, mhd, url, method, slot);
    Connection& connection = **held;
    if (*upload_data_size != 0) {
      // The wire bytes are bounded too: a body above the limit closes the
      // connection (no answer can be queued while a body arrives).
      if (connection.request.body.size() + *upload_data_size > server.options_.max_body_bytes) {
        return MHD_NO;
      }
      connection.request.body.append(upload_data, *upload_data_size);
      *upload_data_size = 0;
      return MHD_YES;
    }
    return OnWholeRequest(server, *held);
  }

  static void OnCompleted(void* cls, MHD_Connection*, void** slot, MHD_RequestTerminationCode) {
    auto* held = static_cast<std::shared_ptr<Connection>*>(*slot);
    if (held == nullptr) return;
    bool handed_over;
    {
      MutexLock lock((*held)->mu);
      handed_over = (*held)->handed_over;
    }
    delete held;
    *slot = nullptr;
    if (handed_over) {
      HttpServer::InFlight& in_flight = *static_cast<HttpServer*>(cls)->in_flight_;
      MutexLock lock(in_flight.mu);
      if (--in_flight.count == 0) in_flight.done.NotifyAll();
    }
  }

 private:
  static MHD_Result OnHeaders(HttpServer& server, MHD_Connection* mhd, const char* url,
                              const char* method, void** slot) {
    auto connection = std::make_shared<Connection>(server, mhd);
    HttpRequest& request = connection->request;
    request.method = method;
    request.path = url;
    MHD_get_connection_values(mhd, MHD_HEADER_KIND, &CollectHeader, &request.headers);
    *slot = new std::shared_ptr<Connection>(connection);
    const std::string& cors = server.options_.cors_origin;
    if (!cors.empty() && request.method == "OPTIONS") {  // a CORS preflight
      connection->response.status = 204;
      connection->response.headers = {
          {"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
          {"Access-Control-Allow-Headers",
           "Authorization, Content-Type, Content-Encoding, Inference-Header-Content-Length"},
          {"Access-Control-Max-Age", "600"}};
      return Queue(*connection, cors);
    }
    if (!server.options_.tls_client_ca_pem.empty() && !ClientCertificateVerified(mhd)) {
      return Refuse(*connection, 403,
                    "a client certificate signed by --tls_client_ca is needed (mutual TLS)", cors);
    }
    const absl::string_view length = request.Header("content-length");
    uint64_t bytes = 0;
    if (!length.empty() && absl::SimpleAtoi(length, &bytes) &&
        bytes > server.options_.max_body_bytes) {
      return Refuse(*connection, 413,
                    absl::StrCat("request body of ", bytes, " bytes is above the limit of ",
                                 server.options_.max_body_bytes, " (--max_message_bytes)"),
                    cors);
    }
    // Its whole size at once: the body is not copied as it grows.
    if (bytes > 0) connection->request.body.reserve(static_cast<size_t>(bytes));
    return MHD_YES;  // the body follows (after 100 Continue when asked for)
  }

  static MHD_Result OnWholeRequest(HttpServer& server, const std::shared_ptr<Connection>& held) {
    Connection& connection = *held;
    MutexLock lock(connection.mu);
    if (connection.answered) return Queue(connection, server.options_.cors_origin);  // resumed
    if (connection.handed_over) return MHD_YES;
    absl::StatusOr<std::string> body =
        DecodeContent(connection.request.Header("content-encoding"),
                      std::move(connection.request.body), server.options_.max_body_bytes);
    if (!body.ok()) {
      const int status = absl::IsResourceExhausted(body.status()) ? 413 : 400;
      return Refuse(connection, status, body.status().message(), server.options_.cors_origin);
    }
    connection.request.body = *std::move(body);
    connection.handed_over = true;
    {
      MutexLock count(server.in_flight_->mu);
      ++server.in_flight_->count;
    }
    lock.Unlock();
    server.handler_.Handle(connection.request, [held](HttpResponse response) {
      MutexLock answer(held->mu);
      held->response = std::move(response);
      held->answered = true;
      if (held->suspended) {  // queued when libmicrohttpd calls again
        held->suspended = false;
        MHD_resume_connection(held->mhd);
      }
    });
    lock.Lock();
    if (connection.answered) return Queue(connection, server.options_.cors_origin);
    connection.suspended = true;  // holds no thread while it waits
    MHD_suspend_connection(connection.mhd);
    return MHD_YES;
  }
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options,
                                                              HttpHandler& handler) {
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(options), handler));
  server->in_flight_ = std::make_shared<InFlight>();
  const HttpServerOptions& o = server->options_;
  sockaddr_in v4{};
  sockaddr_in6 v6{};
  const sockaddr* address = nullptr;
  unsigned int flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME;
  if (inet_pton(AF_INET, o.host.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    v4.sin_port = htons(static_cast<uint16_t>(o.port));
    address = reinterpret_cast<const sockaddr*>(&v4);
  } else if (inet_pton(AF_INET6, o.host.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    v6.sin6_port = htons(static_cast<uint16_t>(o.port));
    address = reinterpret_cast<const sockaddr*>(&v6);
    flags |= MHD_USE_IPv6;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--host ", o.host, ": the HTTP port needs a numeric IPv4 or IPv6 address"));
  }
  const bool tls = !o.tls_cert_pem.empty() && !o.tls_key_pem.empty();
  if (tls) flags |= MHD_USE_TLS;
  const unsigned int timeout_s =
      static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(o.idle_timeout)));
  server->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(o.port), nullptr, nullptr, &HttpServerCallbacks::OnRequest,
      server.get(), MHD_OPTION_NOTIFY_COMPLETED, &HttpServerCallbacks::OnCompleted, server.get(),
      MHD_OPTION_SOCK_ADDR, address, MHD_OPTION_THREAD_POOL_SIZE,
      static_cast<unsigned int>(std::max(1, o.threads)), MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned int>(o.max_connections), MHD_OPTION_CONNECTION_TIMEOUT, timeout_s,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, o.max_header_bytes,
      tls ? MHD_OPTION_HTTPS_MEM_KEY : MHD_OPTION_END, o.tls_key_pem.c_str(),
      MHD_OPTION_HTTPS_MEM_CERT, o.tls_cert_pem.c_str(),
      o.tls_client_ca_pem.empty() ? MHD_OPTION_END : MHD_OPTION_HTTPS_MEM_TRUST,
      o.tls_client_ca_pem.c_str(), MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("--http_port: cannot serve HTTP on ", o.host, ":",
                                               o.port, " (in use, or a bad certificate?)"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr && info->port != 0 ? info->port : o.port;
  return server;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::StopAccepting() {
  if (daemon_ != nullptr) MHD_quiesce_daemon(daemon_);
}

void HttpServer::Stop(absl::Duration grace) {
  if (daemon_ == nullptr) return;
  StopAccepting();
  {
    MutexLock lock(in_flight_->mu);
    const absl::Time until = absl::Now() + grace;
    while (in_flight_->count > 0 && absl::Now() < until) in_flight_->done.WaitUntil(lock, until);
  }
  MHD_stop_daemon(daemon_);
  daemon_ = nullptr;
}

namespace {

// Runs zlib's inflate over `in` (windowBits as inflateInit2's).
absl::StatusOr<std::string> Inflate(absl::string_view in, int window_bits, size_t max_bytes) {
  z_stream z{};
  if (inflateInit2(&z, window_bits) != Z_OK) return absl::InternalError("zlib: cannot start");
  std::string out;
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  int result = Z_OK;
  while (result != Z_STREAM_END) {
    const size_t have = out.size();
    const size_t room = std::max<size_t>(16 << 10, have);  // doubles as it grows
    if (have >= max_bytes + 1) break;
    out.resize(std::min(have + room, max_bytes + 1));
    z.next_out = reinterpret_cast<Bytef*>(out.data() + have);
    z.avail_out = static_cast<uInt>(out.size() - have);
    result = inflate(&z, Z_NO_FLUSH);
    out.resize(out.size() - z.avail_out);
    if (result == Z_BUF_ERROR && z.avail_in == 0) break;  // truncated
    if (result != Z_OK && result != Z_STREAM_END && result != Z_BUF_ERROR) break;
  }
  inflateEnd(&z);
  if (out.size() > max_bytes) {
    return TooLargeError(
        absl::StrCat("request body is above the limit of ", max_bytes, " bytes once decompressed"));
  }
  if (result != Z_STREAM_END) {
    return absl::InvalidArgumentError("request body: a broken or truncated compressed stream");
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> DecodeContent(absl::string_view encoding, std::string body,
                                          size_t max_bytes) {
  const std::string e = absl::AsciiStrToLower(absl::StripAsciiWhitespace(encoding));
  if (e.empty() || e == "identity") return body;
  if (e == "gzip" || e == "x-gzip") return Inflate(body, 15 + 16, max_bytes);
  if (e == "deflate") {  // zlib-wrapped, as the RFC says; raw deflate as browsers once sent
    absl::StatusOr<std::string> wrapped = Inflate(body, 15, max_bytes);
    if (wrapped.ok() || absl::IsResourceExhausted(wrapped.status())) return wrapped;
    return Inflate(body, -15, max_bytes);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Content-Encoding '", encoding, "' is not served (gzip, deflate or identity)"));
}

std::string GzipOf(absl::string_view data) {
  z_stream z{};
  deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace mha::server
