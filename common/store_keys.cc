#include "common/store_keys.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

}  // namespace gradsync
