// /v2/logging: Triton's logging extension over HTTP. GET answers every log
// setting; POST changes those its JSON object names (all or none, as
// LogSettings over gRPC: server/frontends/common/log_settings.h) and answers
// every setting as it is now. Values are JSON booleans, non-negative
// integers or strings, as Triton's.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_LOGGING_H_
#define MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_LOGGING_H_

#include "server/frontends/common/kserve_calls.h"
#include "server/frontends/kserve_http/http_server.h"

namespace mha::server {

HttpResponse LoggingAnswer(const KserveCalls& calls, const HttpRequest& request);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_LOGGING_H_
