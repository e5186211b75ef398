#pragma once

// Which keys of a job's store belong to whom: the one rule the Store service applies to every
// generic call, and the prefixes the daemons build their own keys under.

#include <cstdint>
#include <string>

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

/// An elastic job's membership records, all under kElasticKeyPrefix: trainers read them, only
/// daemons write them (joins through the typed calls TakeTicket, WithdrawTicket, AdmitJoiners).
/// In the epoch's namespace, its next membership; in the job's home (epoch 0's namespace), the
/// joining nodes' tickets taken and handled, each ticket ("ranks=K", "claimed", "withdrawn")
/// and each admitted ticket's place ("epoch=E world=W rank=R min=M").
inline constexpr absl::string_view kElasticKeyPrefix = "_gradsync_elastic/";
inline constexpr absl::string_view kElasticDecisionKey = "_gradsync_elastic/decision";
inline constexpr absl::string_view kElasticTicketsKey = "_gradsync_elastic/tickets";
inline constexpr absl::string_view kElasticHandledKey = "_gradsync_elastic/handled";
std::string ElasticTicketKey(int64_t ticket);
std::string ElasticAdmitKey(int64_t ticket);

/// What the generic Store calls (Get, Wait, Set, Add, CompareSet, Delete, List) may do with a key.
enum class KeyClass {
  kClient,         // a client's own key-values: read and written by any caller of the job
  kTyped,          // "_gradsync/" (pack plans): read by anyone, written only by typed calls
  kDaemonWritten,  // membership records: read by anyone, written by daemons only
  kDaemonOnly,     // the daemons' own keys (above): read and written by daemons only
};

KeyClass ClassOfKey(absl::string_view key);

}  // namespace gradsync
