#include "server/frontends/common/auth.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/file_read.h"

namespace mha::server {
namespace {

// Equal strings, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<BearerAuth> BearerAuth::FromFile(const std::string& path) {
  if (path.empty()) return BearerAuth();
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("cannot read token file ", path));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
  return BearerAuth(std::move(token));
}

absl::Status BearerAuth::Check(absl::string_view authorization) const {
  if (!enabled()) return absl::OkStatus();
  constexpr absl::string_view kScheme = "Bearer ";
  if (!absl::StartsWith(authorization, kScheme) ||
      !ConstantTimeEquals(authorization.substr(kScheme.size()), token_)) {
    return absl::UnauthenticatedError(
        "missing or wrong bearer token (gRPC metadata or HTTP header 'authorization')");
  }
  return absl::OkStatus();
}

}  // namespace mha::server
