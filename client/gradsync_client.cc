// Implementation of gradsync_client.h: the session stream driven on callers' threads, sealed
// memfd buffers passed over the fd channel, and ops sent through the doorbell ring or the stream.

#include "client/gradsync_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace gradsync::client {
namespace {

// How long past an op's own deadline the client waits for the daemon's verdict (which names
// the missing ranks) before giving up on the daemon itself.
constexpr absl::Duration kAnswerMargin = absl::Seconds(10);

void* TagOf(intptr_t tag) { return reinterpret_cast<void*>(tag); }

// Memory shared with the daemon: an anonymous memfd (no name anyone could watch, open or
// squat), sized, then sealed so it can never shrink under the daemon's mapping (which would
// fault it) nor grow; the daemon checks the seals (F_GET_SEALS) before it maps.
absl::StatusOr<int> CreateSealedMemfd(const char* label, int64_t bytes) {
  const int fd = ::memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot size and seal ", bytes, " bytes of shared memory: ", std::strerror(err)));
  }
  return fd;
}

void AddSegments(const std::vector<Segment>& segments,
                 google::protobuf::RepeatedPtrField<v1::Segment>* out) {
  out->Reserve(static_cast<int>(segments.size()));
  for (const Segment& s : segments) {
    v1::Segment* seg = out->Add();
    seg->set_buffer_id(s.buffer_id);
    seg->set_byte_offset(s.byte_offset);
    seg->set_count(s.count);
  }
}

v1::OpRequest MakeOp(v1::OpKind kind, DType dtype, const OpOptions& options) {
  v1::OpRequest op;
  op.set_kind(kind);
  op.set_dtype(dtype);
  op.set_group(options.group);
  op.set_name(options.name);
  op.set_timeout_ms(absl::ToInt64Milliseconds(options.timeout));
  return op;
}

}  // namespace

struct Op::State {
  // Guarded by the client's mu_ (not annotated: a State does not know its client).
  uint64_t tag = 0;  // its key in the client's pending_ while not done
  bool via_doorbell = false;
  bool done = false;
  absl::Status status;
  v1::TrainerEvent event;
  absl::Time deadline;  // give up on the daemon after this
};

absl::Status Op::Wait() {
  if (!state_) return absl::FailedPreconditionError("empty Op");
  return client_->Await(*state_, state_->deadline);
}

bool Op::WaitFor(absl::Duration slice, absl::Status* status) {
  if (!state_) {
    *status = absl::FailedPreconditionError("empty Op");
    return true;
  }
  const absl::Time limit = std::min(state_->deadline, absl::Now() + slice);
  absl::Status s = client_->Await(*state_, limit);
  bool done = false;
  {
    absl::MutexLock lock(&client_->mu_);
    done = state_->done;
  }
  if (!done && absl::Now() < state_->deadline) return false;
  *status = std::move(s);
  return true;
}

bool Op::Done() { return state_ && client_->Poll(*state_); }

uint64_t Op::seq() {
  if (!state_) return 0;
  absl::MutexLock lock(&client_->mu_);
  return state_->event.seq();
}

SharedBuffer::~SharedBuffer() {
  if (size_ > 0) ::munmap(data_, static_cast<size_t>(size_));
}

Client::Client(Placement placement, ClientOptions options)
    : placement_(std::move(placement)), options_(options) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(absl::string_view target,
                                                        const Placement& placement,
                                                        ClientOptions options) {
  // Debian's abseil is built with Mutex deadlock detection on (a debug aid: a process-wide
  // graph updated on every lock, and an abort on a suspected lock cycle). The daemon turns it
  // off in main.cc; a trainer's process does here, so the client's locks cost what the
  // std::mutex they replaced did and a trainer never dies of a suspicion.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::unique_ptr<Client> client(new Client(placement, options));
  GRADSYNC_RETURN_IF_ERROR(client->Open(target));
  v1::TrainerRequest request;
  v1::RegisterRequest& reg = *request.mutable_register_session();
  if (options.doorbell) {
    GRADSYNC_ASSIGN_OR_RETURN(std::string token, client->CreateDoorbell());
    reg.set_doorbell_fd_token(std::move(token));
  }
  reg.set_job(placement.job);
  reg.set_world_size(placement.world_size);
  reg.set_rank(placement.rank);
  reg.set_local_rank(placement.local_rank);
  reg.set_local_world_size(placement.local_world_size);
  reg.set_root_address(placement.root_address);
  reg.set_elastic(placement.elastic);
  reg.set_epoch(placement.epoch);
  GRADSYNC_ASSIGN_OR_RETURN(v1::TrainerEvent event, client->Call(std::move(request)));
  if (event.register_session().default_op_timeout_ms() > 0) {
    client->default_op_timeout_ =
        absl::Milliseconds(event.register_session().default_op_timeout_ms());
  }
  return client;
}

absl::Status Client::Open(absl::string_view target) {
  if (const std::string t = NormalizeTarget(target); absl::StartsWith(t, "unix:")) {
    fd_channel_path_ = t.substr(5) + ".fd";  // the daemon's fd channel, beside its socket
  }
  channel_ = client::Connect(target, options_);
  stub_ = v1::GradSync::NewStub(channel_);
  Authorize(ctx_, options_);
  stream_ = stub_->PrepareAsyncSession(&ctx_, &cq_);
  absl::MutexLock lock(&mu_);
  StartLocked(kStart);
  DriveUntilLocked([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !InFlightLocked(kStart); },
                   absl::Now() + options_.rpc_timeout);
  if (!started_) {
    BreakLocked(absl::UnavailableError("never connected"));
    return absl::UnavailableError(absl::StrCat("cannot reach gradsyncd at ", target));
  }
  StartLocked(kRead);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Client::CreateDoorbell() {
  const size_t bytes = doorbell::RegionBytes();
  GRADSYNC_ASSIGN_OR_RETURN(const int fd, CreateSealedMemfd("gradsync-doorbell", bytes));
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map the doorbell: ", std::strerror(err)));
  }
  doorbell_base_ = static_cast<std::byte*>(p);
  doorbell_ = std::make_unique<doorbell::Doorbell>(doorbell_base_);
  doorbell_->Initialize();
  absl::StatusOr<std::string> token = ShareFd(fd);
  ::close(fd);
  return token;
}

absl::StatusOr<int> ConnectFdChannel(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0 || ::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    if (sock >= 0) ::close(sock);
    return absl::UnavailableError(
        absl::StrCat("cannot reach gradsyncd's fd channel ", path, ": ", std::strerror(err)));
  }
  return sock;
}

absl::StatusOr<std::string> SendFd(int sock, int fd, absl::Time deadline) {
  char request = 'F';
  iovec iov{&request, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(sock, &msg, MSG_NOSIGNAL) != 1) {
    return absl::UnavailableError(
        absl::StrCat("cannot send to gradsyncd's fd channel: ", std::strerror(errno)));
  }
  // The reply: a status byte, a length byte, that many bytes (the token or the reason).
  std::string reply;
  size_t want = 2;
  while (reply.size() < want) {
    pollfd p{sock, POLLIN, 0};
    const int left =
        static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    if (::poll(&p, 1, left) <= 0) {
      return absl::DeadlineExceededError("no answer from gradsyncd's fd channel");
    }
    char buf[258];
    const ssize_t n = ::recv(sock, buf, want - reply.size(), 0);
    if (n <= 0) return absl::UnavailableError("gradsyncd's fd channel closed");
    reply.append(buf, static_cast<size_t>(n));
    if (want == 2 && reply.size() == 2) want = 2 + static_cast<unsigned char>(reply[1]);
  }
  const int code = static_cast<unsigned char>(reply[0]);
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), reply.substr(2));
  return reply.substr(2);
}

absl::StatusOr<std::string> Client::ShareFd(int fd) {
  absl::MutexLock lock(&fd_mu_);
  if (fd_channel_path_.empty()) {
    return absl::FailedPreconditionError(
        "trainer sessions are local: connect through the daemon's unix socket (memory is "
        "handed over its fd channel, which TCP cannot carry)");
  }
  if (fd_sock_ < 0) {
    GRADSYNC_ASSIGN_OR_RETURN(fd_sock_, ConnectFdChannel(fd_channel_path_));
  }
  absl::StatusOr<std::string> token = SendFd(fd_sock_, fd, absl::Now() + options_.rpc_timeout);
  if (!token.ok() && (token.status().code() == absl::StatusCode::kUnavailable ||
                      token.status().code() == absl::StatusCode::kDeadlineExceeded)) {
    ::close(fd_sock_);  // the connection is in an unknown state: the next call opens another
    fd_sock_ = -1;
  }
  return token;
}

Client::~Client() {
  if (fd_sock_ >= 0) ::close(fd_sock_);
  struct Unmap {
    std::byte* base;
    ~Unmap() {
      if (base != nullptr) ::munmap(base, doorbell::RegionBytes());
    }
  } unmap{doorbell_base_};  // last: after the session has ended
  if (!stream_) return;
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  {
    absl::MutexLock lock(&mu_);
    // Let queued requests go out, then close our side; the daemon ends the session and the
    // stream finishes. If it does not in time (a stuck or stopped daemon), cancel.
    auto flushed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !broken_.ok() || (!InFlightLocked(kWrite) && writes_.empty());
    };
    DriveUntilLocked(flushed, deadline);
    if (broken_.ok() && StartLocked(kWritesDone)) {
      DriveUntilLocked([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !broken_.ok(); },
                       deadline);
    }
    // Once the call is cancelled gRPC completes every operation in flight promptly (a failed
    // read starts Finish, which completes too). The queue is shut down only after that, and
    // nothing starts on it afterwards; whatever still arrives is taken off below.
    if (in_flight_ != 0) {
      ctx_.TryCancel();
      DriveUntilLocked([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; },
                       absl::Now() + options_.rpc_timeout);
    }
    queue_shut_down_ = true;
    BreakLocked(absl::UnavailableError("client closed"));
  }
  cq_.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok)) {
    absl::MutexLock relock(&mu_);
    HandleLocked(reinterpret_cast<intptr_t>(tag), ok);
  }
}

bool Client::StartLocked(Tag tag) {
  const uint32_t bit = TagBit(tag);
  if (queue_shut_down_ || (in_flight_ & bit) != 0) return false;
  switch (tag) {
    case kStart:
      stream_->StartCall(TagOf(kStart));
      break;
    case kWrite:  // gRPC allows one write at a time, WritesDone included, none after it
      if (writes_.empty() || writes_done_ || InFlightLocked(kWritesDone)) return false;
      stream_->Write(writes_.front(), TagOf(kWrite));
      break;
    case kWritesDone:
      if (writes_done_ || InFlightLocked(kWrite)) return false;
      writes_done_ = true;
      stream_->WritesDone(TagOf(kWritesDone));
      break;
    case kRead:
      event_.Clear();
      stream_->Read(&event_, TagOf(kRead));
      break;
    case kFinish:  // once, after a read failed (the server has nothing more to send)
      if (finish_started_) return false;
      finish_started_ = true;
      stream_->Finish(&finish_status_, TagOf(kFinish));
      break;
  }
  in_flight_ |= bit;
  return true;
}

void Client::StartWriteLocked() {
  if (broken_.ok()) StartLocked(kWrite);
}

void Client::BreakLocked(const absl::Status& status) {
  if (broken_.ok()) broken_ = status;
  for (auto& [tag, state] : pending_) {
    state->done = true;
    state->status = broken_;
  }
  pending_.clear();
  ring_in_flight_ = 0;
  while (writes_.size() > (InFlightLocked(kWrite) ? 1u : 0u)) writes_.pop_back();
}

void Client::HandleLocked(intptr_t tag, bool ok) {
  in_flight_ &= ~TagBit(tag);
  switch (tag) {
    case kStart:
      started_ = ok;
      break;
    case kWrite:
      if (!writes_.empty()) writes_.pop_front();
      if (ok) StartWriteLocked();  // a failed write: the read side reports why
      break;
    case kRead:
      if (ok) {
        auto it = pending_.find(event_.tag());
        if (it != pending_.end()) {
          Op::State& state = *it->second;
          state.done = true;
          state.status =
              event_.code() == 0
                  ? absl::OkStatus()
                  : absl::Status(static_cast<absl::StatusCode>(event_.code()), event_.message());
          state.event = std::move(event_);
          pending_.erase(it);
        }
        StartLocked(kRead);
      } else {
        StartLocked(kFinish);
      }
      break;
    case kFinish:
      BreakLocked(finish_status_.ok() ? absl::UnavailableError("gradsyncd ended the session")
                                      : FromGrpcStatus(finish_status_));
      break;
    case kWritesDone:
      break;
    default:
      // Only this file's tags are on the queue: anything else is a bug, and no op may be left
      // waiting on a stream whose state is now unknown.
      BreakLocked(absl::InternalError(absl::StrCat("unknown completion-queue tag ", tag)));
      break;
  }
}

std::shared_ptr<Op::State> Client::Send(v1::TrainerRequest request, absl::Duration answer_within) {
  auto state = std::make_shared<Op::State>();
  state->deadline = absl::Now() + answer_within;
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      state->done = true;
      state->status = broken_;
      return state;
    }
    const uint64_t tag = next_tag_++;
    request.set_tag(tag);
    state->tag = tag;
    pending_.emplace(tag, state);
    writes_.push_back(std::move(request));
    StartWriteLocked();
  }
  Poll(*state);  // move the write queue along without blocking
  return state;
}

bool Client::Poll(Op::State& state) {
  absl::MutexLock lock(&mu_);
  DrainRingLocked();
  if (!state.done) CheckStreamLocked();
  return state.done;
}

grpc::CompletionQueue::NextStatus Client::DriveOnceLocked(absl::Time deadline) {
  void* tag = nullptr;
  bool ok = false;
  driving_ = true;
  mu_.Unlock();
  const auto r = cq_.AsyncNext(&tag, &ok, absl::ToChronoTime(deadline));
  mu_.Lock();
  driving_ = false;
  if (r == grpc::CompletionQueue::GOT_EVENT) HandleLocked(reinterpret_cast<intptr_t>(tag), ok);
  if (r == grpc::CompletionQueue::SHUTDOWN) BreakLocked(absl::UnavailableError("client closed"));
  cv_.SignalAll();
  return r;
}

bool Client::DriveUntilLocked(const std::function<bool()>& done, absl::Time deadline) {
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    if (driving_) {  // another thread polls; it wakes us after each event
      cv_.WaitWithDeadline(&mu_, deadline);
    } else {
      DriveOnceLocked(deadline);
    }
  }
  return true;
}

void Client::DrainRingLocked() {
  if (!doorbell_) return;
  doorbell::Completion c;
  while (doorbell_->Next(&c)) {
    --ring_in_flight_;
    auto it = pending_.find(c.tag);
    if (it == pending_.end()) continue;
    Op::State& state = *it->second;
    state.done = true;
    state.status = c.code == 0 ? absl::OkStatus()
                               : absl::Status(static_cast<absl::StatusCode>(c.code),
                                              absl::string_view(c.message, c.message_bytes));
    state.event.set_seq(c.seq);
    pending_.erase(it);
  }
}

void Client::CheckStreamLocked() {
  // A deadline in the past: take the events already there, never wait. (The epoch, not
  // InfinitePast: gRPC reads a time before the epoch as no deadline at all.)
  while (!driving_ && DriveOnceLocked(absl::UnixEpoch()) == grpc::CompletionQueue::GOT_EVENT) {
  }
}

std::shared_ptr<Op::State> Client::Ring(v1::TrainerRequest request, absl::Duration answer_within) {
  auto state = std::make_shared<Op::State>();
  state->via_doorbell = true;
  state->deadline = absl::Now() + answer_within;
  absl::MutexLock lock(&mu_);
  const uint64_t tag = next_tag_++;
  request.set_tag(tag);
  const std::string record = request.SerializeAsString();
  // Bounded: the daemon drains the ring continuously; a dead daemon breaks the stream.
  for (;;) {
    if (!broken_.ok()) {
      state->done = true;
      state->status = broken_;
      return state;
    }
    if (record.size() + 64 > doorbell::kRequestRingBytes / 2) {
      state->done = true;
      state->status = absl::InvalidArgumentError(absl::StrCat(
          "op request of ", record.size(), " bytes is larger than the doorbell allows"));
      return state;
    }
    DrainRingLocked();
    if (ring_in_flight_ < static_cast<int>(doorbell::kCompletionSlots) && doorbell_->Push(record)) {
      break;
    }
    CheckStreamLocked();
    if (absl::Now() >= state->deadline) {
      state->done = true;
      state->status = absl::DeadlineExceededError("doorbell ring stayed full; is gradsyncd stuck?");
      return state;
    }
    mu_.Unlock();
    doorbell_->TrainerWait(absl::Milliseconds(1));
    mu_.Lock();
  }
  ++ring_in_flight_;
  state->tag = tag;
  pending_.emplace(tag, state);
  return state;
}

absl::Status Client::Await(Op::State& state, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (state.via_doorbell) {
    // Completions come by the ring; the stream is only looked at now and then, for the news
    // that the session broke.
    absl::Time next_check = absl::Now();
    for (;;) {
      DrainRingLocked();
      if (state.done) return state.status;
      const absl::Time now = absl::Now();
      if (now >= next_check) {
        CheckStreamLocked();
        if (state.done) return state.status;
        next_check = now + absl::Milliseconds(20);
      }
      if (now >= deadline) return GiveUpLocked(state);
      mu_.Unlock();
      doorbell_->TrainerWait(std::min(absl::Milliseconds(2), deadline - now));
      mu_.Lock();
    }
  }
  if (!DriveUntilLocked([&] { return state.done; }, deadline)) return GiveUpLocked(state);
  return state.status;
}

absl::Status Client::GiveUpLocked(Op::State& state) {
  const absl::Status timed_out = absl::DeadlineExceededError(
      "no answer from gradsyncd by the op's deadline (plus margin); is the daemon stuck?");
  if (absl::Now() < state.deadline) return timed_out;  // a caller's slice, not the op's end
  // The op's outcome from now on, whatever the daemon answers later (the answer to its tag is
  // dropped; a ring slot it holds is freed when the daemon completes it).
  state.done = true;
  state.status = timed_out;
  if (auto it = pending_.find(state.tag); it != pending_.end() && it->second.get() == &state) {
    pending_.erase(it);
  }
  return state.status;
}

absl::StatusOr<v1::TrainerEvent> Client::Call(v1::TrainerRequest request) {
  std::shared_ptr<Op::State> state = Send(std::move(request), options_.rpc_timeout);
  GRADSYNC_RETURN_IF_ERROR(Await(*state, state->deadline));
  absl::MutexLock lock(&mu_);
  return state->event;
}

absl::StatusOr<uint64_t> Client::RegisterBuffer(const v1::RegisterBufferRequest& request) {
  v1::TrainerRequest req;
  *req.mutable_register_buffer() = request;
  GRADSYNC_ASSIGN_OR_RETURN(v1::TrainerEvent event, Call(std::move(req)));
  return event.register_buffer().buffer_id();
}

absl::Status Client::DeregisterBuffer(uint64_t buffer_id) {
  v1::TrainerRequest req;
  req.mutable_deregister_buffer()->set_buffer_id(buffer_id);
  return Call(std::move(req)).status();
}

absl::Status Client::Settle() {
  v1::TrainerRequest req;
  req.mutable_settle();
  // As long as the ops it waits for may take.
  std::shared_ptr<Op::State> state =
      Send(std::move(req), std::max(options_.rpc_timeout, default_op_timeout_));
  return Await(*state, state->deadline);
}

absl::StatusOr<std::unique_ptr<SharedBuffer>> Client::CreateBuffer(int64_t bytes, DType dtype) {
  if (bytes < 0) return absl::InvalidArgumentError("buffer size must not be negative");
  GRADSYNC_ASSIGN_OR_RETURN(const int fd, CreateSealedMemfd("gradsync-buffer", bytes));
  std::byte* data = nullptr;
  absl::Status status;
  if (bytes > 0) {
    void* p =
        ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("cannot map ", bytes, " bytes of shared memory: ", std::strerror(errno)));
    } else {
      data = static_cast<std::byte*>(p);
    }
  }
  absl::StatusOr<std::string> token =
      status.ok() ? ShareFd(fd) : absl::StatusOr<std::string>(status);
  ::close(fd);  // the mappings (ours, and the daemon's once registered) keep the memory
  std::unique_ptr<SharedBuffer> buffer(new SharedBuffer(data, data ? bytes : 0, dtype));
  if (!token.ok()) return token.status();
  v1::RegisterBufferRequest req;
  req.set_fd_token(*std::move(token));
  req.set_bytes(bytes);
  req.set_dtype(dtype);
  GRADSYNC_ASSIGN_OR_RETURN(buffer->id_, RegisterBuffer(req));
  return buffer;
}

absl::Status Client::DestroyBuffer(std::unique_ptr<SharedBuffer> buffer) {
  if (!buffer) return absl::OkStatus();
  return DeregisterBuffer(buffer->id());
}

Op Client::Submit(const v1::OpRequest& op) {
  v1::TrainerRequest req;
  *req.mutable_op() = op;
  const absl::Duration timeout =
      op.timeout_ms() > 0 ? absl::Milliseconds(op.timeout_ms()) : default_op_timeout_;
  if (doorbell_) return Op(this, Ring(std::move(req), timeout + kAnswerMargin));
  return Op(this, Send(std::move(req), timeout + kAnswerMargin));
}

Op Client::AllReduceAsync(DType dtype, v1::ReduceOp reduce, std::vector<Segment> data,
                          const OpOptions& options) {
  v1::OpRequest op = MakeOp(v1::ALL_REDUCE, dtype, options);
  op.set_reduce_op(reduce);
  AddSegments(data, op.mutable_input());
  return Submit(op);
}

Op Client::BroadcastAsync(DType dtype, int root, std::vector<Segment> data,
                          const OpOptions& options) {
  v1::OpRequest op = MakeOp(v1::BROADCAST, dtype, options);
  op.set_root(root);
  AddSegments(data, op.mutable_input());
  return Submit(op);
}

Op Client::BarrierAsync(const OpOptions& options) {
  return Submit(MakeOp(v1::BARRIER, v1::DTYPE_UNSPECIFIED, options));
}

Op Client::AllGatherAsync(DType dtype, std::vector<Segment> input, std::vector<Segment> output,
                          const OpOptions& options) {
  v1::OpRequest op = MakeOp(v1::ALL_GATHER, dtype, options);
  AddSegments(input, op.mutable_input());
  AddSegments(output, op.mutable_output());
  return Submit(op);
}

Op Client::ReduceScatterAsync(DType dtype, v1::ReduceOp reduce, std::vector<Segment> input,
                              std::vector<Segment> output, const OpOptions& options) {
  v1::OpRequest op = MakeOp(v1::REDUCE_SCATTER, dtype, options);
  op.set_reduce_op(reduce);
  AddSegments(input, op.mutable_input());
  AddSegments(output, op.mutable_output());
  return Submit(op);
}

}  // namespace gradsync::client
