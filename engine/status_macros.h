// Status propagation macros (Debian's Abseil 20220623 ships none).
#ifndef MHA_ENGINE_STATUS_MACROS_H_
#define MHA_ENGINE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MHA_CONCAT_INNER_(a, b) a##b
#define MHA_CONCAT_(a, b) MHA_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status mha_status_ = (expr);       \
    if (!mha_status_.ok()) return mha_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` declares/assigns `x` from the value of
// an absl::StatusOr, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  MHA_ASSIGN_OR_RETURN_IMPL_(MHA_CONCAT_(mha_statusor_, __LINE__), lhs, expr)

#define MHA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)    \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // MHA_ENGINE_STATUS_MACROS_H_
