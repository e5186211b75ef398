// Implementation of store.h: the blocking Store calls (WaitBlocking, Get, Wait) built on
// WaitAsync.

#include "common/store.h"

#include <memory>

#include "absl/synchronization/notification.h"

namespace gradsync {

absl::StatusOr<std::vector<std::string>> Store::WaitBlocking(absl::string_view job,
                                                             std::vector<std::string> keys,
                                                             absl::Time deadline) {
  struct Result {
    absl::Notification done;
    absl::StatusOr<std::vector<std::string>> values;
  };
  auto result = std::make_shared<Result>();
  WaitAsync(job, std::move(keys), deadline, [result](absl::StatusOr<std::vector<std::string>> v) {
    result->values = std::move(v);
    result->done.Notify();
  });
  // The store fires `done` at the deadline at the latest; it is the store's deadline, not ours.
  result->done.WaitForNotification();
  return std::move(result->values);
}

absl::StatusOr<std::string> Store::Get(absl::string_view job, absl::string_view key,
                                       absl::Time deadline) {
  auto values = WaitBlocking(job, {std::string(key)}, deadline);
  if (!values.ok()) return values.status();
  return std::move(values->front());
}

absl::Status Store::Wait(absl::string_view job, std::vector<std::string> keys,
                         absl::Time deadline) {
  return WaitBlocking(job, std::move(keys), deadline).status();
}

}  // namespace gradsync
