// Optional bearer-token authentication of the attention and model RPCs.
#ifndef MHA_SERVER_FRONTENDS_AUTH_H_
#define MHA_SERVER_FRONTENDS_AUTH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::server {

// Holds the one accepted token (never logged). Empty token: every call is
// allowed. Immutable; thread-safe.
class BearerAuth {
 public:
  BearerAuth() = default;
  explicit BearerAuth(std::string token) : token_(std::move(token)) {}

  // Reads the token from a file (surrounding whitespace trimmed); an empty
  // path means no authentication.
  static absl::StatusOr<BearerAuth> FromFile(const std::string& path);

  bool enabled() const { return !token_.empty(); }

  // OK when auth is off or `authorization` is "Bearer <token>";
  // UNAUTHENTICATED otherwise. Compares in time independent of where the
  // token differs.
  absl::Status Check(absl::string_view authorization) const;

 private:
  std::string token_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_AUTH_H_
