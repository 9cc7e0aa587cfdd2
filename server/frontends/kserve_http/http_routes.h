// KServe v2 over HTTP/REST, route for route as Triton serves it (server and
// model health, metadata, config, statistics, infer; the repository and
// shared-memory extensions): each route decodes its JSON (or binary) body
// into the protocol's message, calls KserveCalls as the gRPC service does,
// and encodes the answer. Errors are {"error": "..."} with Triton's status
// codes.
#ifndef MHA_SERVER_FRONTENDS_HTTP_ROUTES_H_
#define MHA_SERVER_FRONTENDS_HTTP_ROUTES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/frontends/common/kserve_calls.h"
#include "server/frontends/kserve_http/http_server.h"

namespace mha::server {

// The HTTP status of a refusal, so that a client's retry logic acts
// rightly (docs/KSERVE.md, "Errors"): 400 for a bad request, 404 for an
// unknown model, 401/403 for auth, 413 for a request or answer larger than
// a limit (IsTooLarge: never passes as it is), 503 for what may pass later
// (draining, unavailable, a queue or the memory budget full now), 504 for a
// deadline that passed, 501 for what is not served, 500 otherwise.
int HttpStatusOf(const absl::Status& status);
// The header that names a refusal's gRPC code ("RESOURCE_EXHAUSTED"), so
// that an HTTP client reports the code a gRPC client would.
inline constexpr char kStatusCodeHeader[] = "mha-status-code";
// A refusal's answer: {"error": message} (never empty) with its status,
// the mha-status-code header, and Retry-After: 1 with a 503.
HttpResponse HttpError(const absl::Status& status);

// Borrows KserveCalls (which outlives it). Thread-safe.
class KserveHttpRoutes final : public HttpHandler {
 public:
  explicit KserveHttpRoutes(KserveCalls& calls) : calls_(calls) {}
  void Handle(const HttpRequest& request, HttpRespond respond) override;

 private:
  // /v2/models/{name}[/versions/{version}][/{verb}]: `segments` after "models".
  void HandleModel(const HttpRequest& request, const std::vector<std::string>& segments,
                   HttpRespond& respond);
  void Infer(const HttpRequest& request, const std::string& model, const std::string& version,
             HttpRespond respond);
  void HandleRepository(const HttpRequest& request, const std::vector<std::string>& segments,
                        HttpRespond& respond);
  void HandleSharedMemory(const HttpRequest& request, const std::vector<std::string>& segments,
                          bool cuda, HttpRespond& respond);

  KserveCalls& calls_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_HTTP_ROUTES_H_
