// How trainers hand the daemon their memory, tried as a hostile local process would: memory
// is a sealed memfd passed over the fd channel, never a name; whatever a trainer does to it,
// the daemon stays up and no session reaches memory it was not handed. Real gradsyncd, real
// sockets, a second (unprivileged) user through setpriv.

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/gradsync_client.h"
#include "common/doorbell.h"
#include "gradsync/v1/gradsync.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

class SharedMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcess::Options options;
    options.tcp = false;
    auto daemon = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }

  std::unique_ptr<client::Client> Connect(const std::string& job, int world = 1, int rank = 0) {
    auto c = client::Client::Connect(daemon_->unix_target(), {job, world, rank, rank, world, ""});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  bool Serving() {
    auto c = Connect("probe-" + std::to_string(probes_++));
    if (!c) return false;
    auto buf = c->CreateBuffer(64);
    return buf.ok() && c->AllReduce(v1::FLOAT32, v1::SUM, {{(*buf)->id(), 0, 16}}).ok();
  }

  int DaemonMemfdMappings() {
    std::ifstream maps(absl::StrCat("/proc/", daemon_->pid(), "/maps"));
    int n = 0;
    for (std::string line; std::getline(maps, line);)
      n += absl::StrContains(line, "memfd:gradsync-");
    return n;
  }

  static int SealedMemfd(int64_t bytes, unsigned seals) {
    const int fd = ::memfd_create("gradsync-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, bytes) != 0) return -1;
    if (seals != 0 && ::fcntl(fd, F_ADD_SEALS, seals) != 0) return -1;
    return fd;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  int probes_ = 0;
};

std::set<std::string> DevShm() {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) names.insert(e->d_name);
    ::closedir(d);
  }
  return names;
}

// The SIGBUS attack: register memory, then shrink it to nothing. The client's memory is sealed
// (the shrink fails), memory that is not sealed is refused, and the daemon stays up.
TEST_F(SharedMemoryTest, MemoryCannotShrinkUnderTheDaemon) {
  auto c = Connect("shrink");
  ASSERT_TRUE(c);
  const int fd = SealedMemfd(4096, F_SEAL_SHRINK);
  ASSERT_GE(fd, 0);
  auto token = c->ShareFd(fd);
  ASSERT_TRUE(token.ok()) << token.status();
  v1::RegisterBufferRequest req;
  req.set_fd_token(*token);
  req.set_bytes(4096);
  auto id = c->RegisterBuffer(req);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(::ftruncate(fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
  // The daemon reads and writes every byte of it, unharmed.
  EXPECT_TRUE(c->AllReduce(v1::FLOAT32, v1::SUM, {{*id, 0, 1024}}).ok());

  for (unsigned seals : {0u, static_cast<unsigned>(F_SEAL_GROW | F_SEAL_WRITE)}) {
    const int loose = SealedMemfd(4096, seals);
    ASSERT_GE(loose, 0);
    auto t = c->ShareFd(loose);
    ASSERT_TRUE(t.ok()) << t.status();
    req.set_fd_token(*t);
    auto refused = c->RegisterBuffer(req);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "not sealed against shrinking"))
        << refused.status();
    ::ftruncate(loose, 0);  // what the attacker would do next: the daemon never mapped it
    ::close(loose);
  }
  // A descriptor that is not shared memory at all (a regular file here).
  const std::string path = dir_.path() + "/plain";
  const int file = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0);
  ASSERT_EQ(::ftruncate(file, 4096), 0);
  auto t = c->ShareFd(file);
  ASSERT_TRUE(t.ok()) << t.status();
  req.set_fd_token(*t);
  auto refused = c->RegisterBuffer(req);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  ::close(file);
  ::close(fd);
  EXPECT_TRUE(Serving());
}

// Memory is never named: registration by name is refused, for buffers and doorbells, and a
// trainer leaves nothing in /dev/shm that another process could watch, open or squat.
TEST_F(SharedMemoryTest, NothingIsRegisteredOrCreatedByName) {
  // A 0600 object of this user: by name, even an object that exists is refused.
  const std::string name = "/gradsync-test-named-" + std::to_string(::getpid());
  const int named = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(named, 0);
  ASSERT_EQ(::ftruncate(named, 4096), 0);
  ::close(named);
  auto c = Connect("named");
  ASSERT_TRUE(c);
  v1::RegisterBufferRequest req;
  req.set_shm_name(name);
  req.set_bytes(4096);
  auto refused = c->RegisterBuffer(req);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  ::shm_unlink(name.c_str());

  // A doorbell by name ends the registration.
  RawSession raw;
  ASSERT_TRUE(raw.Start(daemon_->unix_target(), "named-doorbell", "", "/gradsync-whatever"));
  auto& stream = raw.stream;
  v1::TrainerEvent event;
  EXPECT_FALSE(stream->Read(&event));
  const grpc::Status end = stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();

  // Squatting: a trainer's buffers and doorbell appear nowhere in /dev/shm.
  const std::set<std::string> before = DevShm();
  auto d = Connect("squat", 2, 0);
  auto e = Connect("squat", 2, 1);
  ASSERT_TRUE(d && e);
  std::vector<std::unique_ptr<client::SharedBuffer>> buffers;
  for (int i = 0; i < 8; ++i) {
    auto b = (i % 2 ? e : d)->CreateBuffer(1 << 16);
    ASSERT_TRUE(b.ok()) << b.status();
    buffers.push_back(*std::move(b));
  }
  EXPECT_EQ(DevShm(), before);
  EXPECT_GE(DaemonMemfdMappings(), 8 + 2);  // the daemon maps them (and both doorbells)
  buffers.clear();
  d.reset();
  e.reset();
  EXPECT_TRUE(Serving());
}

// A token is one-time: redeemed once, by the registration naming it; unknown tokens are
// NOT_FOUND; a token redeemed by one session cannot be used by another (NOT_FOUND), and the
// session that redeemed it is told the buffer exists.
TEST_F(SharedMemoryTest, TokensAreRedeemedOnce) {
  auto a = Connect("tokens", 2, 0);
  auto b = Connect("tokens", 2, 1);
  ASSERT_TRUE(a && b);
  const int fd = SealedMemfd(4096, F_SEAL_SHRINK);
  auto token = a->ShareFd(fd);
  ::close(fd);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(token->size(), 32u);
  v1::RegisterBufferRequest req;
  req.set_fd_token(*token);
  req.set_bytes(4096);
  EXPECT_TRUE(a->RegisterBuffer(req).ok());
  EXPECT_EQ(b->RegisterBuffer(req).status().code(), absl::StatusCode::kNotFound);
  // The session that redeemed it has that buffer already.
  EXPECT_EQ(a->RegisterBuffer(req).status().code(), absl::StatusCode::kAlreadyExists);
  req.set_fd_token("not a token");
  EXPECT_EQ(a->RegisterBuffer(req).status().code(), absl::StatusCode::kNotFound);
  req.clear_fd_token();
  EXPECT_EQ(a->RegisterBuffer(req).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Serving());
}

// A trainer hands its doorbell over twice and registers the second copy as a data buffer (so
// that collective results would land in its ring): refused; the session and daemon go on.
TEST_F(SharedMemoryTest, ADoorbellCannotAlsoBeADataBuffer) {
  const int fd = SealedMemfd(doorbell::RegionBytes(), F_SEAL_SHRINK);
  ASSERT_GE(fd, 0);
  void* p = ::mmap(nullptr, doorbell::RegionBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  doorbell::Doorbell(static_cast<std::byte*>(p)).Initialize();
  auto first = ShareFd(daemon_->socket_path(), fd);
  auto second = ShareFd(daemon_->socket_path(), fd);
  ::close(fd);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(*first, *second);

  RawSession raw;
  ASSERT_TRUE(raw.Start(daemon_->unix_target(), "twice", *first));
  auto& stream = raw.stream;
  v1::TrainerEvent event;
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.code(), 0) << event.message();

  v1::TrainerRequest buf;
  buf.set_tag(2);
  buf.mutable_register_buffer()->set_fd_token(*second);
  buf.mutable_register_buffer()->set_bytes(4096);
  ASSERT_TRUE(stream->Write(buf));
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.tag(), 2u);
  EXPECT_EQ(event.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << event.message();
  EXPECT_TRUE(absl::StrContains(event.message(), "doorbell")) << event.message();
  stream->WritesDone();
  stream->Finish();
  ::munmap(p, doorbell::RegionBytes());
  EXPECT_TRUE(Serving());
}

// A user the 0660 sockets refuse cannot hand memory in either: the fd channel has the gRPC
// socket's mode. (Its folder is opened up so the socket's own mode is what refuses.)
TEST_F(SharedMemoryTest, AnotherUserCannotReachTheFdChannel) {
  if (::geteuid() != 0 || ::access("/usr/bin/setpriv", X_OK) != 0) {
    GTEST_SKIP() << "needs root and setpriv to act as another user";
  }
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  const std::string channel = daemon_->socket_path() + ".fd";
  struct stat st {};
  ASSERT_EQ(::stat(channel.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  const std::string out = dir_.path() + "/nobody.out";
  auto pid = Spawn({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                    "/usr/bin/python3", "-c",
                    "import socket, sys\n"
                    "for p in sys.argv[1:]:\n"
                    "    s = socket.socket(socket.AF_UNIX)\n"
                    "    try:\n"
                    "        s.connect(p); print('connected', p)\n"
                    "    except PermissionError:\n"
                    "        print('refused', p)\n",
                    channel, daemon_->socket_path()},
                   {}, out);
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto code = WaitExit(*pid, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  const std::string text = ReadFile(out);
  EXPECT_TRUE(absl::StrContains(text, "refused " + channel)) << text;
  EXPECT_TRUE(absl::StrContains(text, "refused " + daemon_->socket_path())) << text;
  EXPECT_FALSE(absl::StrContains(text, "connected")) << text;
  // The owner can (the test itself).
  auto sock = client::ConnectFdChannel(channel);
  ASSERT_TRUE(sock.ok()) << sock.status();
  ::close(*sock);
  EXPECT_TRUE(Serving());
}

}  // namespace
}  // namespace gradsync::testing
