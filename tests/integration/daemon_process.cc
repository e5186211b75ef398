#include "tests/integration/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/gradsync_client.h"
#include "gtest/gtest.h"

extern char** environ;

namespace gradsync::testing {

// The build's paths, unless the environment moves them (tests/gpu/run.sh runs a bundle of the
// binaries on another machine).
std::string DaemonBinary() {
  const char* env = std::getenv("GRADSYNC_DAEMON_PATH");
  return env != nullptr && *env ? env : GRADSYNC_DAEMON_PATH;
}
std::string HelperBinary(const std::string& name) {
  const char* env = std::getenv("GRADSYNC_TEST_BIN_DIR");
  return absl::StrCat(env != nullptr && *env ? env : GRADSYNC_TEST_BIN_DIR, "/", name);
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::vector<std::string>& extra_env,
                            const std::string& stdout_path, const std::string& stderr_path) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    // The test runner itself may run under systemd; the child must only see ours.
    if (absl::StartsWith(*e, "NOTIFY_SOCKET=") || absl::StartsWith(*e, "WATCHDOG_")) continue;
    env.emplace_back(*e);
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
  }
  if (!stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
  }
  // The child starts with no blocked signals, whatever the test runner blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, cargv[0], &actions, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0)
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
  return pid;
}

absl::StatusOr<int> WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    } else if (r < 0) {
      return absl::InternalError(absl::StrCat("waitpid ", pid, ": ", std::strerror(errno)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int> WaitAll(const std::vector<pid_t>& pids, absl::Duration timeout) {
  std::vector<int> codes;
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] < 0) {
      codes.push_back(0);
      continue;
    }
    auto code = WaitExit(pids[i], std::max(deadline - absl::Now(), absl::Seconds(1)));
    if (!code.ok()) {
      ::kill(pids[i], SIGKILL);
      (void)WaitExit(pids[i], absl::Seconds(10));
      ADD_FAILURE() << "process " << i << " (pid " << pids[i] << ") did not finish in time";
      code = -1;
    }
    codes.push_back(*code);
  }
  return codes;
}

TempDir::TempDir() {
  std::string templ = (std::filesystem::temp_directory_path() / "gradsync-test-XXXXXX").string();
  path_ = ::mkdtemp(templ.data());
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(const std::string& dir,
                                                                    Options options) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  d->socket_path_ = dir + "/gradsyncd.sock";
  const std::string notify_path = dir + "/notify";
  d->notify_fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, notify_path.c_str(), sizeof(addr.sun_path) - 1);
  ::unlink(notify_path.c_str());  // left by an earlier daemon of the same test
  if (::bind(d->notify_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::InternalError(absl::StrCat("bind ", notify_path, ": ", std::strerror(errno)));
  }
  if (::pipe2(d->stop_pipe_, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
  d->reader_ = std::thread([p = d.get()] { p->ReadNotifications(); });

  std::vector<std::string> argv = {DaemonBinary(), "--socket=" + d->socket_path_,
                                   "--log_sink=stderr", "--log_level=debug"};
  argv.push_back(options.tcp ? "--port=0" : "--port=-1");
  const bool own_token =
      std::any_of(options.flags.begin(), options.flags.end(),
                  [](const std::string& f) { return absl::StartsWith(f, "--token_file="); });
  if (options.tcp && !own_token) {
    d->token_ = kTestToken;
    d->token_file_ = dir + "/cluster.token";
    std::ofstream(d->token_file_) << d->token_ << "\n";
    ::chmod(d->token_file_.c_str(), 0600);
    argv.push_back("--token_file=" + d->token_file_);
  }
  argv.insert(argv.end(), options.flags.begin(), options.flags.end());
  argv.insert(argv.begin(), options.wrapper.begin(), options.wrapper.end());
  std::vector<std::string> env = {"NOTIFY_SOCKET=" + notify_path};
  if (options.watchdog > absl::ZeroDuration()) {
    env.push_back(absl::StrCat("WATCHDOG_USEC=", absl::ToInt64Microseconds(options.watchdog)));
  }
  auto pid = Spawn(argv, env, "", options.stderr_path);
  if (!pid.ok()) return pid.status();
  d->pid_ = *pid;
  const absl::Time ready_deadline = absl::Now() + options.ready_timeout;
  while (d->CountNotifications("READY=1") == 0) {
    if (auto code = WaitExit(d->pid_, absl::ZeroDuration()); code.ok()) {
      d->exited_ = true;
      return absl::FailedPreconditionError(
          absl::StrCat("gradsyncd exited with code ", *code, " before READY=1"));
    }
    if (absl::Now() > ready_deadline) {
      return absl::DeadlineExceededError("gradsyncd did not send READY=1 in time");
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  for (const std::string& n : d->Notifications()) {
    // "tcp=<bind address>:<port>"
    const size_t at = n.find("tcp=");
    if (at == std::string::npos) continue;
    absl::string_view rest = absl::string_view(n).substr(at);
    rest = rest.substr(0, rest.find_first_of(" \n"));
    rest = rest.substr(rest.rfind(':') + 1);
    rest = rest.substr(0, rest.find_first_not_of("0123456789"));
    if (!absl::SimpleAtoi(rest, &d->tcp_port_)) return absl::InternalError("bad STATUS= port");
  }
  if (options.tcp && d->tcp_port_ <= 0) return absl::InternalError("no tcp port in STATUS=");
  return d;
}

void DaemonProcess::ReadNotifications() {
  char buf[4096];
  while (true) {
    pollfd fds[2] = {{notify_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, 1000) < 0) return;
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      const ssize_t n = ::recv(notify_fd_, buf, sizeof(buf), 0);
      if (n <= 0) continue;
      absl::MutexLock lock(&mu_);
      notifications_.emplace_back(buf, n);
    }
  }
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    (void)WaitExit(pid_, absl::Seconds(10));
  }
  if (stop_pipe_[1] >= 0) {
    (void)!::write(stop_pipe_[1], "x", 1);
    if (reader_.joinable()) reader_.join();
    ::close(stop_pipe_[0]);
    ::close(stop_pipe_[1]);
  }
  if (notify_fd_ >= 0) ::close(notify_fd_);
}

absl::StatusOr<int> DaemonProcess::Stop(int signo, absl::Duration timeout) {
  ::kill(pid_, signo);
  auto code = WaitExit(pid_, timeout);
  if (code.ok()) exited_ = true;
  return code;
}

std::vector<std::string> DaemonProcess::Notifications() {
  absl::MutexLock lock(&mu_);
  return notifications_;
}

int DaemonProcess::CountNotifications(const std::string& needle) {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& s : notifications_) n += absl::StrContains(s, needle) ? 1 : 0;
  return n;
}

bool DaemonProcess::WaitForNotification(const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (CountNotifications(needle) > 0) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

bool RawSession::Start(const std::string& unix_target, const std::string& job,
                       const std::string& doorbell_fd_token, const std::string& doorbell_shm_name) {
  stub = v1::GradSync::NewStub(client::Connect(unix_target));
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  stream = stub->Session(&ctx);
  v1::TrainerRequest reg;
  reg.set_tag(1);
  v1::RegisterRequest& r = *reg.mutable_register_session();
  r.set_job(job);
  r.set_world_size(1);
  r.set_local_world_size(1);
  r.set_doorbell_fd_token(doorbell_fd_token);
  r.set_doorbell_shm_name(doorbell_shm_name);
  return stream->Write(reg);
}

int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  return ok ? ntohs(addr.sin_port) : -1;
}

absl::StatusOr<std::string> ShareFd(const std::string& socket_path, int fd) {
  absl::StatusOr<int> sock = client::ConnectFdChannel(socket_path + ".fd");
  if (!sock.ok()) return sock.status();
  absl::StatusOr<std::string> token = client::SendFd(*sock, fd, absl::Now() + absl::Seconds(10));
  ::close(*sock);
  return token;
}

}  // namespace gradsync::testing
