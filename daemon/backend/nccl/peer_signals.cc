// Cross-node failure signalling for NCCL groups spanning nodes (see peer_signals.h).

#include "daemon/backend/nccl/peer_signals.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "daemon/backend/nccl/backoff.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// "nccl/<run>/<group>/": where a group's keys live in the job's store, in this run of the job.
std::string GroupKeys(const std::string& run, const std::string& group) {
  return absl::StrCat(kNcclKeyPrefix, run, run.empty() ? "" : "/", group, "/");
}

}  // namespace

std::string FailKey(const core::CommunicatorSpec& spec, uint64_t seq) {
  return absl::StrCat(GroupKeys(spec.run, spec.group), "fail/", seq);
}
std::string BrokenKey(const std::string& run, const std::string& group, uint64_t built_at) {
  return absl::StrCat(GroupKeys(run, group), "broken/", built_at);
}
std::string IdKey(const core::CommunicatorSpec& spec, uint64_t built_at) {
  return absl::StrCat(GroupKeys(spec.run, spec.group), built_at, "/id");
}

bool WriteWhileRunLasts(gradsync::Store* store, const std::string& job, const std::string& run,
                        const std::string& key, std::string value) {
  if (!run.empty()) {
    absl::StatusOr<std::string> current = store->Get(job, core::kRunKey, absl::InfinitePast());
    if (!current.ok() || *current != run) {
      Log()->debug("run over, not told job={} run={} key={}", job, run, key);
      return false;
    }
  }
  if (absl::Status s = store->Set(job, key, std::move(value)); !s.ok()) {
    Log()->warn("could not tell the other nodes job={} key={} error={}", job, key, s.ToString());
    return false;
  }
  return true;
}

void DeferredWrites::WriteWhileRunLasts(gradsync::Store* store, std::string job, std::string run,
                                        std::string key, std::string value) {
  writes_.push_back([store, job = std::move(job), run = std::move(run), key = std::move(key),
                     value = std::move(value)]() mutable {
    nccl::WriteWhileRunLasts(store, job, run, key, std::move(value));
  });
}

void DeferredWrites::Delete(gradsync::Store* store, std::string job, std::string key) {
  writes_.push_back(
      [store, job = std::move(job), key = std::move(key)] { (void)store->Delete(job, key); });
}

void DeferredWrites::Flush() {
  std::vector<std::function<void()>> writes;
  writes.swap(writes_);
  for (auto& write : writes) write();
}

BackgroundKeyWait::BackgroundKeyWait(gradsync::Store* store, const std::string& job,
                                     std::string key, absl::Time deadline)
    : store_(store), state_(std::make_shared<State>()) {
  id_ = store_->WaitAsync(job, {std::move(key)}, deadline,
                          [state = state_](absl::StatusOr<std::vector<std::string>> v) {
                            absl::MutexLock lock(&state->mu);
                            state->finished = true;
                            if (v.ok()) state->value = std::move((*v)[0]);
                          });
}

BackgroundKeyWait::~BackgroundKeyWait() {
  bool finished;
  {
    absl::MutexLock lock(&state_->mu);
    finished = state_->finished;
  }
  if (!finished) store_->CancelWait(id_);
}

std::optional<std::string> BackgroundKeyWait::value() const {
  absl::MutexLock lock(&state_->mu);
  return state_->value;
}

PeerFailureWatch::~PeerFailureWatch() { JoinPublisher(); }

void PeerFailureWatch::JoinPublisher() {
  if (publisher_.joinable()) publisher_.join();
}

void PeerFailureWatch::PublishInBackground() {
  if (publishing_) return;
  publishing_ = true;
  publisher_ = std::thread([store = store_, job = spec_.job, run = spec_.run,
                            key = FingerprintKey(spec_.node), value = fingerprint_,
                            published = published_]() mutable {
    published->store(nccl::WriteWhileRunLasts(store, job, run, key, std::move(value)) ? 1 : 2);
  });
}

void PeerFailureWatch::WatchFingerprints(const std::vector<std::string>& nodes) {
  for (const std::string& node : nodes) {
    if (node == spec_.node || theirs_.count(node)) continue;
    theirs_[node] =
        std::make_unique<BackgroundKeyWait>(store_, spec_.job, FingerprintKey(node), op_.deadline);
  }
}

absl::Status PeerFailureWatch::CompareArrived() {
  for (const auto& [node, wait] : theirs_) {
    if (compared_.count(node)) continue;
    std::optional<std::string> theirs = wait->value();
    if (!theirs) continue;
    if (*theirs != fingerprint_) {
      desync_ = true;  // the other node finds the same, from this node's fingerprint
      return Desync(node, *theirs);
    }
    compared_.insert(node);
  }
  return absl::OkStatus();
}

absl::Status PeerFailureWatch::Check() {
  if (interrupt_) {
    if (absl::Status s = interrupt_(); !s.ok()) return s;
  }
  if (store_ == nullptr) return absl::OkStatus();
  if (!fail_) {
    if (absl::Now() - start_ < kWatchAfter) return absl::OkStatus();
    fail_.emplace(store_, spec_.job, FailKey(spec_, op_.seq), op_.deadline);
    PublishInBackground();  // (CompareBeforeLaunch may have published already)
    WatchFingerprints(spec_.member_nodes);
  }
  // Not with `fail_` alone: a watch begun in CompareBeforeLaunch, before RunsOn, watches the
  // communicators too once the op knows them.
  if (built_at_ && !broken_) {
    broken_.emplace(store_, spec_.job, BrokenKey(spec_.run, spec_.group, *built_at_), op_.deadline);
  }
  std::optional<std::string> failed = fail_->value();
  std::optional<std::string> broken = broken_ ? broken_->value() : std::nullopt;
  // A desync says more than another node's failure, which it may well have caused (a node
  // publishes its fingerprint before it can fail the op, and the store answers waits in the
  // order of its writes).
  if (absl::Status s = CompareArrived(); !s.ok()) return s;
  if (failed) {
    peer_failed_op_ = true;
    return absl::AbortedError(absl::StrCat("another node failed this op: ", *failed));
  }
  if (broken) {
    peer_broke_comms_ = true;
    return absl::AbortedError(
        absl::StrCat("another node abandoned the group's NCCL communicators: ", *broken));
  }
  return absl::OkStatus();
}

void PeerFailureWatch::Finished(const absl::Status& result) {
  JoinPublisher();
  if (published_->load() == 1 && result.ok()) {
    (void)store_->Delete(spec_.job, FingerprintKey(spec_.node));
  }
}

std::string PeerFailureWatch::FingerprintKey(absl::string_view node) const {
  return absl::StrCat(GroupKeys(spec_.run, spec_.group), "op/", op_.seq, "/", node);
}

absl::Status PeerFailureWatch::Desync(absl::string_view node, absl::string_view theirs) const {
  return absl::FailedPreconditionError(absl::StrCat("desync across nodes in ", op_.label, ": node ",
                                                    spec_.node, " has ", fingerprint_, " but node ",
                                                    node, " has ", theirs));
}

absl::Status PeerFailureWatch::CompareBeforeLaunch(const std::vector<std::string>& other_nodes) {
  if (store_ == nullptr || other_nodes.empty()) return absl::OkStatus();
  // Before the op's lock (NcclCommunicator::Prepare): written here, at once.
  publishing_ = true;
  published_->store(nccl::WriteWhileRunLasts(store_, spec_.job, spec_.run,
                                             FingerprintKey(spec_.node), fingerprint_)
                        ? 1
                        : 2);
  // Each node's key waited for in the background: a node publishes before its first NCCL call,
  // and deletes its key only once the op has completed, which needs every node's calls: no key
  // goes before every node has read it.
  WatchFingerprints(other_nodes);
  Backoff backoff;
  while (true) {
    if (absl::Status s = CompareArrived(); !s.ok()) return s;
    std::vector<std::string> missing;
    for (const std::string& node : other_nodes) {
      if (node != spec_.node && !compared_.count(node)) missing.push_back(node);
    }
    if (missing.empty()) return absl::OkStatus();
    if (absl::Status s = Check(); !s.ok()) return s;
    if (absl::Now() > op_.deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(op_.label, ": node(s) ", absl::StrJoin(missing, ","),
                       " never published their segmentation of the op by its deadline"));
    }
    backoff.Pause();
  }
}

}  // namespace gradsync::backend::nccl
