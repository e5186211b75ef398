// Cross-node failure signalling for NCCL groups spanning nodes (see peer_signals.h).

#include "daemon/backend/nccl/peer_signals.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "daemon/backend/nccl/backoff.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// "nccl/<run>/<group>/": where a group's keys live in the job's store, in this run of the job.
std::string GroupKeys(const std::string& run, const std::string& group) {
  return absl::StrCat("nccl/", run, run.empty() ? "" : "/", group, "/");
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

absl::Status PeerFailureWatch::Check() {
  if (interrupt_) {
    if (absl::Status s = interrupt_(); !s.ok()) return s;
  }
  if (store_ == nullptr) return absl::OkStatus();
  const absl::Time now = absl::Now();
  if (!fail_) {
    if (now - start_ < kWatchAfter) return absl::OkStatus();
    fail_.emplace(store_, spec_.job, FailKey(spec_, op_.seq), op_.deadline);
    if (!published_) {  // (CompareBeforeLaunch may have)
      published_ = nccl::WriteWhileRunLasts(store_, spec_.job, spec_.run,
                                            FingerprintKey(spec_.node), fingerprint_);
    }
  }
  // Not with `fail_` alone: a watch begun in CompareBeforeLaunch, before RunsOn, watches the
  // communicators too once the op knows them.
  if (built_at_ && !broken_) {
    broken_.emplace(store_, spec_.job, BrokenKey(spec_.run, spec_.group, *built_at_), op_.deadline);
  }
  std::optional<std::string> failed = fail_->value();
  std::optional<std::string> broken = broken_ ? broken_->value() : std::nullopt;
  // A desync says more than another node's failure, which it may well have caused.
  if (failed || broken || now >= next_compare_) {
    next_compare_ = now + kCompareEvery;
    if (absl::Status s = CompareFingerprints(); !s.ok()) {
      desync_ = true;  // the other node finds the same, from this node's fingerprint
      return s;
    }
  }
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
  if (published_ && result.ok()) (void)store_->Delete(spec_.job, FingerprintKey(spec_.node));
}

std::string PeerFailureWatch::FingerprintKey(absl::string_view node) const {
  return absl::StrCat(GroupKeys(spec_.run, spec_.group), "op/", op_.seq, "/", node);
}

absl::Status PeerFailureWatch::CompareFingerprints() {
  absl::StatusOr<std::vector<std::string>> keys = store_->List(spec_.job, FingerprintKey(""));
  if (!keys.ok()) return absl::OkStatus();  // nothing published yet
  for (const std::string& key : *keys) {
    const std::string node = key.substr(FingerprintKey("").size());
    if (node == spec_.node || compared_.count(node)) continue;
    // Already past: no waiting for a key its node has deleted meanwhile (its op completed).
    absl::StatusOr<std::string> theirs = store_->Get(spec_.job, key, absl::InfinitePast());
    if (!theirs.ok()) continue;
    compared_.insert(node);
    if (*theirs != fingerprint_) return Desync(node, *theirs);
  }
  return absl::OkStatus();
}

absl::Status PeerFailureWatch::Desync(absl::string_view node, absl::string_view theirs) const {
  return absl::FailedPreconditionError(absl::StrCat("desync across nodes in ", op_.label, ": node ",
                                                    spec_.node, " has ", fingerprint_, " but node ",
                                                    node, " has ", theirs));
}

absl::Status PeerFailureWatch::CompareBeforeLaunch(const std::vector<std::string>& other_nodes) {
  if (store_ == nullptr || other_nodes.empty()) return absl::OkStatus();
  published_ = nccl::WriteWhileRunLasts(store_, spec_.job, spec_.run, FingerprintKey(spec_.node),
                                        fingerprint_);
  // Each node's key waited for in the background: a node publishes before its first NCCL call,
  // and deletes its key only once the op has completed, which needs every node's calls: no key
  // goes before every node has read it.
  std::vector<std::unique_ptr<BackgroundKeyWait>> waits;
  for (const std::string& node : other_nodes) {
    waits.push_back(
        std::make_unique<BackgroundKeyWait>(store_, spec_.job, FingerprintKey(node), op_.deadline));
  }
  Backoff backoff;
  while (true) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < other_nodes.size(); ++i) {
      if (compared_.count(other_nodes[i])) continue;
      std::optional<std::string> theirs = waits[i]->value();
      if (!theirs) {
        missing.push_back(other_nodes[i]);
        continue;
      }
      if (*theirs != fingerprint_) {
        desync_ = true;  // the other node finds the same, from this node's fingerprint
        return Desync(other_nodes[i], *theirs);
      }
      compared_.insert(other_nodes[i]);
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
