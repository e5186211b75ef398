// Implementation of job_id.h: CheckJobId.

#include "common/job_id.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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

std::string ElasticJobId(absl::string_view base, int epoch) {
  return epoch == 0 ? std::string(base) : absl::StrCat(base, ".e", epoch);
}

absl::StatusOr<std::string> ElasticBase(absl::string_view id, int epoch) {
  if (epoch < 0) return absl::InvalidArgumentError(absl::StrCat("epoch ", epoch, " is negative"));
  if (epoch == 0) return std::string(id);
  const std::string suffix = absl::StrCat(".e", epoch);
  if (id.size() <= suffix.size() || !absl::EndsWith(id, suffix)) {
    return absl::InvalidArgumentError(absl::StrCat("elastic job '", id, "' at epoch ", epoch,
                                                   " must have an id ending '", suffix, "'"));
  }
  return std::string(id.substr(0, id.size() - suffix.size()));
}

bool IsEpochOf(absl::string_view id, absl::string_view base) {
  if (id == base) return true;
  absl::string_view rest = id;
  int epoch = 0;
  return absl::ConsumePrefix(&rest, base) && absl::ConsumePrefix(&rest, ".e") &&
         absl::SimpleAtoi(rest, &epoch) && epoch > 0 && id == ElasticJobId(base, epoch);
}

}  // namespace gradsync
