// The HTTP status of every refusal (docs/KSERVE.md, "Errors"): what a client
// may retry looks retryable, what never passes does not.
#include "server/frontends/kserve_http/http_routes.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "engine/too_large.h"
#include "gtest/gtest.h"
#include "server/scheduling/admission.h"

namespace mha::server {
namespace {

std::string HeaderOf(const HttpResponse& r, const std::string& name) {
  for (const auto& [key, value] : r.headers) {
    if (key == name) return value;
  }
  return "";
}

TEST(HttpRoutesTest, EveryCodeHasTheStatusAClientActsOnRightly) {
  const std::pair<absl::Status, int> table[] = {
      {absl::InvalidArgumentError("x"), 400},   {absl::FailedPreconditionError("x"), 400},
      {absl::OutOfRangeError("x"), 400},        {absl::AlreadyExistsError("x"), 400},
      {absl::NotFoundError("x"), 404},          {absl::UnauthenticatedError("x"), 401},
      {absl::PermissionDeniedError("x"), 403},  {TooLargeError("x"), 413},
      {absl::ResourceExhaustedError("x"), 503}, {absl::UnavailableError("x"), 503},
      {absl::DeadlineExceededError("x"), 504},  {absl::UnimplementedError("x"), 501},
      {absl::InternalError("x"), 500},          {absl::UnknownError("x"), 500},
      {absl::DataLossError("x"), 500},
  };
  for (const auto& [status, http] : table) {
    EXPECT_EQ(HttpStatusOf(status), http) << status;
    const HttpResponse r = HttpError(status);
    EXPECT_EQ(r.status, http) << status;
    EXPECT_EQ(HeaderOf(r, kStatusCodeHeader), absl::StatusCodeToString(status.code()));
    EXPECT_EQ(HeaderOf(r, "Retry-After"), http == 503 ? "1" : "") << status;
  }
}

TEST(HttpRoutesTest, TheServersOwnRefusalsAreToldApart) {
  // Never passes as asked: an answer over the message limit, a request
  // larger than the whole budget.
  EXPECT_TRUE(IsTooLarge(TooLargeError("attn_weights would be ...")));
  EXPECT_FALSE(IsTooLarge(absl::ResourceExhaustedError("the budget is full now")));
  EXPECT_FALSE(IsTooLarge(absl::OkStatus()));
  // May pass later: the memory budget full now.
  const absl::Status full = MemoryBudgetFull(90, 100, "request", 20, "to compute");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HttpStatusOf(full), 503);
  // The payload survives a copy (a status travels by value to the door).
  absl::Status copy = TooLargeError("y");
  const absl::Status moved = std::move(copy);
  EXPECT_EQ(HttpStatusOf(moved), 413);
}

}  // namespace
}  // namespace mha::server
