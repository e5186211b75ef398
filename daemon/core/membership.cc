// Implementation of membership.h.

#include "daemon/core/membership.h"

#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/job_id.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/core/backend.h"

namespace gradsync::core {

absl::StatusOr<JoinDecision> DecideJoin(gradsync::Store& store, absl::string_view job, int epoch,
                                        int joined, absl::string_view why) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(job));
  const std::string label = absl::StrCat("DecideJoin job=", job, " epoch=", epoch, ": ");
  if (epoch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(label, "a join starts epoch 1 or later"));
  }
  if (absl::Status s = ElasticBase(job, epoch - 1).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(label, s.message()));
  }
  if (joined < 1 || joined > kMaxJoinedPerDecision) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, "joined=", joined, " is not 1 to ", kMaxJoinedPerDecision));
  }
  if (why.size() > kMaxJoinWhyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, "why is ", why.size(), " bytes, more than ", kMaxJoinWhyBytes));
  }
  for (char c : why) {
    if (!absl::ascii_isprint(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(absl::StrCat(label,
                                                     "why holds a character that is not "
                                                     "printable ASCII"));
    }
  }
  // The epoch formed: its run token is there and every rank published its node. The world is
  // the count of those, so a caller cannot name another.
  if (!store.Get(job, kRunKey, absl::InfinitePast()).ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(label, "the namespace holds no formed job (no run token)"));
  }
  if (!store.Get(job, kElasticKey, absl::InfinitePast()).ok()) {
    return absl::FailedPreconditionError(absl::StrCat(label, "the job is not elastic"));
  }
  auto ranks = store.List(job, kRankKeyPrefix);
  if (!ranks.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(label, ranks.status().message()));
  }
  const int world = static_cast<int>(ranks->size());
  for (int r = 0; r < world; ++r) {
    if (!store.Get(job, RankKey(r), absl::InfinitePast()).ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(label, "the epoch has not formed: rank ", r, " has no node"));
    }
  }
  if (world == 0) {
    return absl::FailedPreconditionError(absl::StrCat(label, "the epoch has no ranks"));
  }
  if (world + joined > kMaxElasticWorld) {
    return absl::ResourceExhaustedError(absl::StrCat(label, "a world of ", world, " + ", joined,
                                                     " ranks is more than ", kMaxElasticWorld));
  }
  GRADSYNC_ASSIGN_OR_RETURN(
      CompareSetResult recorded,
      store.CompareSet(job, std::string(kElasticDecisionKey), std::nullopt,
                       MembershipDecisionText(epoch, world + joined, {}, {}, joined, why)));
  return JoinDecision{recorded.swapped, std::move(recorded.value)};
}

}  // namespace gradsync::core
