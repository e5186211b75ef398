#pragma once

// Macros that return early from a function on a non-OK absl::Status or StatusOr, and a copy of
// a status for another thread.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GRADSYNC_CONCAT_INNER_(a, b) a##b
#define GRADSYNC_CONCAT_(a, b) GRADSYNC_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define GRADSYNC_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status gradsync_status_ = (expr);            \
    if (!gradsync_status_.ok()) return gradsync_status_; \
  } while (0)

// `lhs = value of expr`, or returns its status from the enclosing function.
#define GRADSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  GRADSYNC_ASSIGN_OR_RETURN_IMPL_(GRADSYNC_CONCAT_(gradsync_statusor_, __LINE__), lhs, expr)
#define GRADSYNC_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                    \
  if (!statusor.ok()) return statusor.status();              \
  lhs = std::move(statusor).value()

namespace gradsync {

/// A copy of `s` that shares nothing with it. An absl::Status shares its message between copies
/// by a reference count; a status handed to another thread (the NCCL aborter, a settle's
/// waiter) is made anew so that the two threads' copies never drop one count (Debian's Abseil
/// is not built with TSan, which then sees a race).
inline absl::Status Unshared(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), std::string(s.message()));
}

}  // namespace gradsync
