#pragma once

// A real etcd cluster for tests: one or three members of Debian's /usr/bin/etcd (etcd-server)
// on free loopback ports, their data in /dev/shm, started by the test and killed and removed by
// the destructor. Tests skip (GTEST_SKIP naming the package) where the binary is absent.
// Header-only: the unit tests (the store suite) and the integration tests (daemons on etcd)
// both use it. Every wait here is bounded.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradsync::testing {

class EtcdCluster {
 public:
  static constexpr char kBinary[] = "/usr/bin/etcd";

  /// Why etcd tests cannot run here ("" when they can).
  static std::string Unavailable() {
    if (::access(kBinary, X_OK) == 0) return "";
    return absl::StrCat(kBinary,
                        " is not installed (Debian package etcd-server; ./setup.sh installs it)");
  }

  /// TLS on the client port: the members' certificate and key (PEM files), and the CA every
  /// client's certificate must chain to (--client-cert-auth).
  struct Tls {
    std::string cert;
    std::string key;
    std::string ca;
  };

  /// Starts `members` members and waits until every one reports healthy (a leader elected).
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      int members, absl::Duration timeout = absl::Seconds(30), std::optional<Tls> tls = {}) {
    std::unique_ptr<EtcdCluster> c(new EtcdCluster());
    c->tls_ = std::move(tls);
    static int serial = 0;
    c->dir_ = absl::StrCat("/dev/shm/gradsync-etcd-", ::getpid(), "-", serial++);
    std::error_code ec;
    std::filesystem::remove_all(c->dir_, ec);
    std::filesystem::create_directories(c->dir_, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", c->dir_, ": ", ec.message()));
    std::vector<std::string> peers;
    for (int i = 0; i < members; ++i) {
      Member m;
      m.name = absl::StrCat("m", i);
      m.client_port = FreePort();
      m.peer_port = FreePort();
      if (m.client_port <= 0 || m.peer_port <= 0) return absl::InternalError("no free port");
      peers.push_back(absl::StrCat(m.name, "=http://127.0.0.1:", m.peer_port));
      c->members_.push_back(m);
    }
    c->initial_cluster_ = absl::StrJoin(peers, ",");
    c->token_ = absl::StrCat("gradsync-test-", ::getpid(), "-", serial);
    for (int i = 0; i < members; ++i) {
      if (absl::Status s = c->Launch(i, /*fresh=*/true); !s.ok()) return s;
    }
    for (int i = 0; i < members; ++i) {
      if (absl::Status s = c->WaitHealthy(i, timeout); !s.ok()) return s;
    }
    return c;
  }

  ~EtcdCluster() {
    for (int i = 0; i < size(); ++i) Kill(i);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  int size() const { return static_cast<int>(members_.size()); }
  /// "127.0.0.1:port" of member i.
  std::string endpoint(int i) const { return absl::StrCat("127.0.0.1:", members_[i].client_port); }
  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (int i = 0; i < size(); ++i) out.push_back(endpoint(i));
    return out;
  }
  /// The --etcd_endpoints value.
  std::string endpoints_flag() const { return absl::StrJoin(endpoints(), ","); }
  const std::string& dir() const { return dir_; }

  /// SIGKILL member i and reap it. Idempotent.
  void Kill(int i) {
    Member& m = members_[i];
    if (m.pid <= 0) return;
    ::kill(m.pid, SIGKILL);
    int status = 0;
    ::waitpid(m.pid, &status, 0);
    m.pid = -1;
  }

  /// Starts a killed member again (its data kept) and waits until it is healthy.
  absl::Status Restart(int i, absl::Duration timeout = absl::Seconds(30)) {
    if (absl::Status s = Launch(i, /*fresh=*/false); !s.ok()) return s;
    return WaitHealthy(i, timeout);
  }

  /// OK once member i answers /health with "true" (it has a leader), within `timeout`.
  absl::Status WaitHealthy(int i, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (members_[i].pid > 0) {
        int status = 0;
        if (::waitpid(members_[i].pid, &status, WNOHANG) == members_[i].pid) {
          members_[i].pid = -1;
          return absl::FailedPreconditionError(
              absl::StrCat("etcd member ", i, " exited; log in ", LogPath(i)));
        }
      }
      if (tls_.has_value() ? absl::StrContains(ReadLog(i), "ready to serve client requests")
                           : Healthy(members_[i].client_port)) {
        return absl::OkStatus();
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::DeadlineExceededError(absl::StrCat("etcd member ", i, " not healthy after ",
                                                    absl::FormatDuration(timeout), "; log in ",
                                                    LogPath(i)));
  }

 private:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
    pid_t pid = -1;
  };

  EtcdCluster() = default;

  std::string LogPath(int i) const { return absl::StrCat(dir_, "/", members_[i].name, ".log"); }

  std::string ReadLog(int i) const {
    std::string text;
    const int fd = ::open(LogPath(i).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return text;
    char buf[4096];
    for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) text.append(buf, n);
    ::close(fd);
    return text;
  }

  absl::Status Launch(int i, bool fresh) {
    const Member& m = members_[i];
    const std::string client =
        absl::StrCat(tls_.has_value() ? "https" : "http", "://127.0.0.1:", m.client_port);
    const std::string peer = absl::StrCat("http://127.0.0.1:", m.peer_port);
    std::vector<std::string> argv = {
        kBinary, "--name=" + m.name, absl::StrCat("--data-dir=", dir_, "/", m.name),
        "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
        "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
        "--initial-cluster=" + initial_cluster_, "--initial-cluster-token=" + token_,
        fresh ? "--initial-cluster-state=new" : "--initial-cluster-state=existing",
        // Quick elections on loopback: a killed leader is replaced within about a second.
        "--heartbeat-interval=50", "--election-timeout=500"};
    if (tls_.has_value()) {
      argv.insert(argv.end(), {"--cert-file=" + tls_->cert, "--key-file=" + tls_->key,
                               "--trusted-ca-file=" + tls_->ca, "--client-cert-auth"});
    }
    const std::string log = LogPath(i);
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the test, however it ends
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(kBinary, args.data());
      ::_exit(127);
    }
    members_[i].pid = pid;
    return absl::OkStatus();
  }

  static int FreePort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    int port = -1;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
    ::close(fd);
    return port;
  }

  // GET /health on the client port: etcd answers {"health":"true"} once it has a leader.
  static bool Healthy(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    std::string reply;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
      if (::write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
        char buf[1024];
        for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) reply.append(buf, n);
      }
    }
    ::close(fd);
    return absl::StrContains(reply, "\"health\":\"true\"");
  }

  std::string dir_;
  std::optional<Tls> tls_;
  std::string initial_cluster_;
  std::string token_;
  std::vector<Member> members_;
};

}  // namespace gradsync::testing
