#pragma once

// Which keys of a job's store belong to whom: the one rule the Store service applies to every
// generic call, and the prefixes the daemons build their own keys under.

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace gradsync {

/// Prefixes of the keys the daemons keep for themselves in a job's namespace. The run token and
/// each rank's node ("daemon/"), the data links' and the peer watch's addresses with their HMAC
/// keys ("records/", "watch/"), NCCL's unique ids and failure signals ("nccl/"): whoever could
/// read or write them could join a link in a daemon's place, redirect one, or fail a job.
inline constexpr absl::string_view kDaemonKeyPrefix = "daemon/";
inline constexpr absl::string_view kRecordLinksKeyPrefix = "records/";
inline constexpr absl::string_view kPeerWatchKeyPrefix = "watch/";
inline constexpr absl::string_view kNcclKeyPrefix = "nccl/";

/// Where the daemons of an elastic job record its next membership, in the epoch's namespace.
/// Trainers read it; only daemons write it (a join through the typed call DecideJoin).
inline constexpr absl::string_view kElasticDecisionKey = "_gradsync_elastic/decision";

/// What the generic Store calls (Get, Wait, Set, Add, CompareSet, Delete, List) may do with a key.
enum class KeyClass {
  kClient,         // a client's own key-values: read and written by any caller of the job
  kTyped,          // "_gradsync/" (pack plans): read by anyone, written only by typed calls
  kDaemonWritten,  // the membership decision: read by anyone, written by daemons only
  kDaemonOnly,     // the daemons' own keys (above): read and written by daemons only
};

KeyClass ClassOfKey(absl::string_view key);

/// The membership decision of an elastic job, as the daemons write it at kElasticDecisionKey
/// and the trainers parse it (gradsync.elastic.parse_decision): `why` last, as it may hold
/// spaces; `joined` only when ranks join; `at` when it was decided (Inspect's epochs measure
/// the change from it). The one writer of the record.
std::string MembershipDecisionText(int epoch, int world, const std::vector<int>& lost_ranks,
                                   const std::vector<std::string>& lost_nodes, int joined,
                                   absl::string_view why);

}  // namespace gradsync
