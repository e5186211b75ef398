#include "daemon/backend/nccl/nccl_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// How often a waiting op looks at its streams and communicators.
constexpr absl::Duration kPoll = absl::Microseconds(50);

// A local member's buffers for one op, checked: one device run each.
struct Member {
  int group_rank = 0;
  int device = -1;
  core::Run in{};
  core::Run out{};  // ALL_GATHER, REDUCE_SCATTER
};

bool HasOutput(v1::OpKind kind) { return kind == v1::ALL_GATHER || kind == v1::REDUCE_SCATTER; }

absl::StatusOr<std::vector<Member>> Members(const core::Collective& op) {
  std::vector<Member> out;
  for (const core::LocalMember& m : op.local) {
    Member member;
    member.group_rank = m.group_rank;
    const bool two = HasOutput(op.kind);
    if (m.input.size() != 1 || (two && m.output.size() != 1)) {
      return absl::UnimplementedError(absl::StrCat(
          op.label, ": on GPU buffers every rank's data must be one contiguous segment (rank ",
          m.group_rank, " has ", m.input.size(), "); fused ops are for host buffers"));
    }
    member.in = m.input[0];
    if (two) member.out = m.output[0];
    for (const core::Run* r : {&member.in, two ? &member.out : nullptr}) {
      if (r == nullptr) continue;
      if (r->buffer == nullptr || r->buffer->device() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(op.label, ": rank ", m.group_rank, " names a host buffer"));
      }
      if (member.device >= 0 && r->buffer->device() != member.device) {
        return absl::InvalidArgumentError(absl::StrCat(op.label, ": rank ", m.group_rank,
                                                       "'s buffers are on devices ", member.device,
                                                       " and ", r->buffer->device()));
      }
      member.device = r->buffer->device();
    }
    out.push_back(member);
  }
  return out;
}

}  // namespace

/// The engine's handle on one group's NCCL collectives; the NCCL state itself lives in the
/// backend (NcclBackend::Comms) so that it outlives this object.
class NcclCommunicator final : public core::Communicator {
 public:
  NcclCommunicator(NcclBackend* backend, core::CommunicatorSpec spec)
      : backend_(backend), api_(backend->api_), spec_(std::move(spec)) {}

  absl::Status Run(const core::Collective& op) override {
    if (!op.local_failure.ok()) return op.local_failure;
    absl::StatusOr<std::vector<Member>> members = Members(op);
    if (!members.ok()) return members.status();
    if (members->empty()) return absl::OkStatus();
    std::shared_ptr<NcclBackend::Comms> c = backend_->CommsFor(spec_.job, spec_.group);
    absl::MutexLock lock(&c->mu);
    if (c->abort_requested.exchange(false)) backend_->AbortLocked(*c);  // aborted while idle
    std::vector<int> devices, ranks;
    for (const Member& m : *members) {
      devices.push_back(m.device);
      ranks.push_back(m.group_rank);
    }
    if (!c->comms.empty() &&
        (c->devices != devices || c->ranks != ranks || c->group_size != op.group_size)) {
      Log()->info("nccl layout changed job={} group={}: rebuilding", spec_.job, spec_.group);
      backend_->AbortLocked(*c);
    }
    if (c->comms.empty()) {
      if (absl::Status s = BuildLocked(*c, op, *members, devices); !s.ok()) return s;
    }
    for (int d : devices) {
      if (c->streams.count(d)) continue;
      absl::StatusOr<gpu::Stream> stream = api_->CreateStream(d);
      if (!stream.ok()) return Context(op, stream.status());
      c->streams[d] = *stream;
    }
    // The daemon's streams wait for the trainers' work on the buffers.
    for (const Member& m : *members) {
      for (const core::Run* r : {&m.in, HasOutput(op.kind) ? &m.out : nullptr}) {
        if (r == nullptr || r->buffer->ready_event() == nullptr) continue;
        if (absl::Status s =
                api_->StreamWaitEvent(m.device, c->streams[m.device], r->buffer->ready_event());
            !s.ok()) {
          return Context(op, s);
        }
      }
    }
    absl::Status s = Launch(*c, op, *members);
    if (!s.ok()) {
      backend_->AbortLocked(*c);
      return Context(op, s);
    }
    // Non-blocking communicators may still be putting the kernels on the streams after
    // ncclGroupEnd: until they are, neither the "done" events nor the streams say anything.
    if (absl::Status e = WaitEnqueuedLocked(*c, op); !e.ok()) return e;
    // The trainers' streams may wait for this: record "done" on every written buffer.
    for (const Member& m : *members) {
      const core::Run& written = HasOutput(op.kind) ? m.out : m.in;
      if (written.buffer->done_event() == nullptr) continue;
      if (absl::Status e =
              api_->RecordEvent(m.device, written.buffer->done_event(), c->streams[m.device]);
          !e.ok()) {
        return Fail(*c, op, e);  // the kernels are queued: abort them before buffers go
      }
    }
    return WaitLocked(*c, op, devices);
  }

 private:
  static absl::Status Context(const core::Collective& op, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(op.label, ": ", s.message()));
  }

  // Creates the group's communicators on this node, one per local member, through one
  // ncclGroupStart/End; the id comes from the node of group rank 0, through the job's store.
  absl::Status BuildLocked(NcclBackend::Comms& c, const core::Collective& op,
                           const std::vector<Member>& members, const std::vector<int>& devices)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    const bool all_local = spec_.local_members.size() == spec_.members.size();
    const bool root_here =
        !spec_.local_members.empty() && spec_.local_members.front() == spec_.members.front();
    const std::string key = absl::StrCat("nccl/", spec_.group, "/", op.seq, "/id");
    std::string id;
    if (root_here) {
      absl::StatusOr<std::string> made = api_->NcclUniqueId();
      if (!made.ok()) return Context(op, made.status());
      id = *made;
      if (!all_local) {
        if (spec_.rendezvous == nullptr) return absl::InternalError("no store to share the id");
        if (absl::Status s = spec_.rendezvous->Set(spec_.job, key, id); !s.ok()) {
          return Context(op, s);
        }
      }
    } else {
      if (spec_.rendezvous == nullptr) return absl::InternalError("no store to fetch the id");
      absl::StatusOr<std::vector<std::string>> got =
          spec_.rendezvous->WaitBlocking(spec_.job, {key}, op.deadline);
      if (!got.ok()) {
        return absl::DeadlineExceededError(absl::StrCat(
            op.label, ": the NCCL id of group ", spec_.group, " never came from the node of rank ",
            spec_.members.front(), " (", got.status().message(), ")"));
      }
      id = (*got)[0];
    }
    std::vector<gpu::Comm> comms;
    absl::Status s = api_->NcclGroupStart();
    for (size_t i = 0; s.ok() && i < members.size(); ++i) {
      absl::StatusOr<gpu::Comm> comm =
          api_->NcclCommInitRank(members[i].device, op.group_size, id, members[i].group_rank);
      ++backend_->comm_inits_;
      if (comm.ok()) {
        comms.push_back(*comm);
      } else {
        s = comm.status();
      }
    }
    if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
    if (s.ok()) {  // non-blocking init
      s = PollReady(comms, op.deadline,
                    absl::StrCat("NCCL communicators of group ", spec_.group, " (", op.group_size,
                                 " ranks) not ready by the deadline: a peer node never joined"));
    }
    if (!s.ok()) {
      for (gpu::Comm comm : comms) (void)api_->NcclCommAbort(comm);
      return Context(op, s);
    }
    c.comms = std::move(comms);
    c.devices = devices;
    c.ranks.clear();
    for (const Member& m : members) c.ranks.push_back(m.group_rank);
    c.group_size = op.group_size;
    Log()->info("nccl communicators ready job={} group={} ranks={} local={} devices={}", spec_.job,
                spec_.group, op.group_size, members.size(), absl::StrJoin(devices, ","));
    return absl::OkStatus();
  }

  absl::Status Launch(NcclBackend::Comms& c, const core::Collective& op,
                      const std::vector<Member>& members) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    absl::Status s = api_->NcclGroupStart();
    for (size_t i = 0; s.ok() && i < members.size(); ++i) {
      const Member& m = members[i];
      gpu::NcclCall call;
      call.kind = op.kind;
      call.reduce_op = op.reduce_op;
      call.dtype = op.dtype;
      call.send = m.in.data;
      call.recv = HasOutput(op.kind) ? m.out.data : m.in.data;
      call.count = op.count;
      call.root = op.root;
      call.comm = c.comms[i];
      call.stream = c.streams[m.device];
      s = api_->NcclCollective(call);
    }
    if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
    return s;
  }

  // Until every communicator has left ncclInProgress (its part of the op is on its stream).
  absl::Status WaitEnqueuedLocked(NcclBackend::Comms& c, const core::Collective& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    absl::Status s = PollReady(c.comms, op.deadline, "NCCL did not enqueue the op by its deadline");
    return s.ok() ? s : Fail(c, op, s);
  }

  // Polls `comms` until all are ready (OK), one reports an error (that error), or `deadline`
  // passes (DEADLINE_EXCEEDED with `late`). Non-blocking communicators leave ncclInProgress
  // after initialising and after each ncclGroupEnd.
  absl::Status PollReady(const std::vector<gpu::Comm>& comms, absl::Time deadline,
                         absl::string_view late) {
    while (true) {
      bool ready = true;
      for (gpu::Comm comm : comms) {
        absl::StatusOr<bool> r = api_->NcclCommReady(comm);
        if (!r.ok()) return r.status();
        ready = ready && *r;
      }
      if (ready) return absl::OkStatus();
      if (absl::Now() > deadline) return absl::DeadlineExceededError(late);
      absl::SleepFor(kPoll);
    }
  }

  // Until the streams have run the op: an async NCCL error, a job-wide abort or the deadline
  // abort the job's communicators on this node and fail the op.
  absl::Status WaitLocked(NcclBackend::Comms& c, const core::Collective& op,
                          const std::vector<int>& devices) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    while (true) {
      bool done = true;
      for (int d : devices) {
        absl::StatusOr<bool> r = api_->StreamDone(d, c.streams[d]);
        if (!r.ok()) return Fail(c, op, r.status());
        done = done && *r;
      }
      if (done) return absl::OkStatus();
      for (gpu::Comm comm : c.comms) {
        absl::StatusOr<bool> r = api_->NcclCommReady(comm);
        if (!r.ok()) return Fail(c, op, r.status());
      }
      if (c.abort_requested.exchange(false)) {
        absl::MutexLock reason_lock(&c.reason_mu);
        const absl::Status why = c.abort_reason;
        backend_->AbortLocked(c);
        return absl::AbortedError(absl::StrCat(
            op.label,
            ": aborted with the job's other NCCL communicators on this node: ", why.message()));
      }
      if (absl::Now() > op.deadline) {
        return Fail(c, op,
                    absl::DeadlineExceededError(
                        "did not complete by its deadline (a peer never entered it, or hung)"));
      }
      absl::SleepFor(kPoll);
    }
  }

  absl::Status Fail(NcclBackend::Comms& c, const core::Collective& op, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    const absl::Status status = Context(op, why);
    Log()->warn("nccl op failed, aborting the job's communicators on this node job={} error={}",
                spec_.job, status.ToString());
    backend_->AbortLocked(c);
    backend_->AbortJob(spec_.job, status);
    return status;
  }

  NcclBackend* const backend_;
  gpu::GpuApi* const api_;
  const core::CommunicatorSpec spec_;
};

NcclBackend::~NcclBackend() {
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Comms>> all;
  {
    absl::MutexLock lock(&mu_);  // never held while taking a Comms::mu (ops hold those first)
    all.swap(comms_);
  }
  for (auto& [key, c] : all) {
    absl::MutexLock c_lock(&c->mu);
    AbortLocked(*c);
    DestroyStreamsLocked(*c);
  }
}

absl::StatusOr<std::shared_ptr<core::Communicator>> NcclBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<NcclCommunicator>(this, spec);
}

std::shared_ptr<NcclBackend::Comms> NcclBackend::CommsFor(const std::string& job,
                                                          const std::string& group) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Comms>& c = comms_[{job, group}];
  if (!c) c = std::make_shared<Comms>();
  return c;
}

void NcclBackend::AbortLocked(Comms& c) {
  for (gpu::Comm comm : c.comms) {
    if (absl::Status s = api_->NcclCommAbort(comm); !s.ok()) {
      Log()->warn("ncclCommAbort failed error={}", s.ToString());
    }
  }
  c.comms.clear();
  c.devices.clear();
  c.ranks.clear();
  c.group_size = 0;
}

void NcclBackend::DestroyStreamsLocked(Comms& c) {
  for (const auto& [device, stream] : c.streams) (void)api_->DestroyStream(device, stream);
  c.streams.clear();
}

void NcclBackend::AbortJob(const std::string& job, const absl::Status& reason) {
  std::vector<std::shared_ptr<Comms>> of_job;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, c] : comms_) {
      if (key.first == job) of_job.push_back(c);
    }
  }
  for (auto& c : of_job) {
    {
      absl::MutexLock reason_lock(&c->reason_mu);
      c->abort_reason = reason;
    }
    if (c->mu.TryLock()) {  // idle: abort now
      AbortLocked(*c);
      c->mu.Unlock();
    } else {  // running an op (possibly the caller's own): it aborts when it next polls
      c->abort_requested = true;
    }
  }
}

void NcclBackend::JobEnded(const std::string& job) {
  std::vector<std::shared_ptr<Comms>> of_job;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = comms_.begin(); it != comms_.end();) {
      if (it->first.first == job) {
        of_job.push_back(it->second);
        it = comms_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : of_job) {
    absl::MutexLock lock(&c->mu);
    AbortLocked(*c);
    DestroyStreamsLocked(*c);
  }
}

namespace {

class DispatchCommunicator final : public core::Communicator {
 public:
  DispatchCommunicator(core::CommunicatorSpec spec, core::Backend* cpu, core::Backend* gpu)
      : spec_(std::move(spec)), cpu_backend_(cpu), gpu_backend_(gpu) {}

  absl::Status Run(const core::Collective& op) override {
    bool host = false, device = false;
    for (const core::LocalMember& m : op.local) {
      for (const core::View* v : {&m.input, &m.output}) {
        for (const core::Run& r : *v) {
          (r.buffer != nullptr && r.buffer->device() >= 0 ? device : host) = true;
        }
      }
    }
    if (host && device) {
      return absl::InvalidArgumentError(
          absl::StrCat(op.label, ": an op takes host or device buffers, not both"));
    }
    std::shared_ptr<core::Communicator>& target = device ? gpu_ : cpu_;
    if (!target) {
      absl::StatusOr<std::shared_ptr<core::Communicator>> made =
          (device ? gpu_backend_ : cpu_backend_)->CreateCommunicator(spec_);
      if (!made.ok()) return made.status();
      target = *std::move(made);
    }
    return target->Run(op);
  }

 private:
  const core::CommunicatorSpec spec_;
  core::Backend* const cpu_backend_;
  core::Backend* const gpu_backend_;
  // A group's ops run one at a time (Communicator contract): no lock needed.
  std::shared_ptr<core::Communicator> cpu_, gpu_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<core::Communicator>> DispatchBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<DispatchCommunicator>(spec, cpu_, gpu_);
}

}  // namespace gradsync::backend::nccl
