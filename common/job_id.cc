// Implementation of job_id.h: CheckJobId.

#include "common/job_id.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace gradsync {

absl::Status CheckJobId(absl::string_view job) {
  if (job.empty()) return absl::InvalidArgumentError("job id is empty");
  if (job.size() > kMaxJobIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id is ", job.size(), " bytes; the limit is ", kMaxJobIdBytes));
  }
  for (char c : job) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(absl::StrCat(
          "job id '", absl::CEscape(job), "' may hold only letters, digits, '-', '_' and '.'"));
    }
  }
  if (job == "." || job == "..") {
    return absl::InvalidArgumentError(absl::StrCat("job id '", job, "' is reserved"));
  }
  return absl::OkStatus();
}

}  // namespace gradsync
