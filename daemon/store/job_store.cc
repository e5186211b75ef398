// Implementation of job_store.h's checks, shared by the job stores.

#include "daemon/store/job_store.h"

#include "absl/strings/str_cat.h"
#include "common/job_id.h"

namespace gradsync::store {

absl::Status CheckJobKey(absl::string_view job, absl::string_view key, int64_t max_key_bytes) {
  if (absl::Status s = CheckJobId(job); !s.ok()) return s;
  if (key.empty()) return absl::InvalidArgumentError("key is empty");
  if (static_cast<int64_t>(key.size()) > max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("key is ", key.size(), " bytes; the limit is ",
                                                   max_key_bytes, " (--store_max_key_bytes)"));
  }
  return absl::OkStatus();
}

absl::Status CheckWaitKeys(absl::string_view job, const std::vector<std::string>& keys,
                           int64_t max_key_bytes) {
  if (keys.empty()) return absl::InvalidArgumentError("wait needs at least one key");
  for (const std::string& key : keys) {
    if (absl::Status s = CheckJobKey(job, key, max_key_bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace gradsync::store
