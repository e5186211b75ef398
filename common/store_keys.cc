#include "common/store_keys.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/pack_list.h"

namespace gradsync {

std::string ElasticTicketKey(int64_t ticket) {
  return absl::StrCat(kElasticKeyPrefix, "ticket/", ticket);
}

std::string ElasticAdmitKey(int64_t ticket) {
  return absl::StrCat(kElasticKeyPrefix, "admit/", ticket);
}

KeyClass ClassOfKey(absl::string_view key) {
  for (absl::string_view prefix :
       {kDaemonKeyPrefix, kRecordLinksKeyPrefix, kPeerWatchKeyPrefix, kNcclKeyPrefix}) {
    if (absl::StartsWith(key, prefix)) return KeyClass::kDaemonOnly;
  }
  if (absl::StartsWith(key, kElasticKeyPrefix)) return KeyClass::kDaemonWritten;
  if (absl::StartsWith(key, kReservedKeyPrefix)) return KeyClass::kTyped;
  return KeyClass::kClient;
}

std::string MembershipDecisionText(int epoch, int world, const std::vector<int>& lost_ranks,
                                   const std::vector<std::string>& lost_nodes, int joined,
                                   absl::string_view why) {
  return absl::StrCat("epoch=", epoch, " world=", world,
                      " lost_ranks=", absl::StrJoin(lost_ranks, ","),
                      " lost_nodes=", absl::StrJoin(lost_nodes, ","),
                      joined > 0 ? absl::StrCat(" joined=", joined) : "",
                      " at=", absl::ToUnixMillis(absl::Now()), " why=", why);
}

}  // namespace gradsync
