#pragma once

// Test harness: a real gradsyncd child process with a temp socket and a free TCP port, started
// the way systemd starts it (NOTIFY_SOCKET, optionally WATCHDOG_USEC), so tests see its sd_notify
// messages. Every wait here is bounded.

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gradsync/v1/gradsync.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::testing {

/// Path of the built binaries (set by CMake).
std::string DaemonBinary();
std::string HelperBinary(const std::string& name);

/// Spawns `argv` (argv[0] is the path) with extra environment entries; returns its pid.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::vector<std::string>& extra_env = {},
                            const std::string& stdout_path = "",
                            const std::string& stderr_path = "");

/// Waits for `pid` to exit until `timeout`; returns its exit code (128+signal if killed).
/// DeadlineExceeded if it is still running (then it is left running).
absl::StatusOr<int> WaitExit(pid_t pid, absl::Duration timeout);

/// The whole file ("" when it cannot be read).
std::string ReadFile(const std::string& path);

/// Waits for every process until one shared `timeout`; a process still running then is killed
/// and reported as a test failure (exit code -1). A pid < 0 (never started) counts as exit 0.
std::vector<int> WaitAll(const std::vector<pid_t>& pids, absl::Duration timeout);

/// A fresh temporary directory, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// A trainer's session stream spoken by hand (no Client), for tests of what a broken or hostile
/// trainer sends. Start() writes the registration; the caller reads its answer.
struct RawSession {
  /// Opens the stream to `unix_target` and sends a registration of rank 0 of a one-rank `job`
  /// naming `doorbell_fd_token` or `doorbell_shm_name` (either may be empty); 20 s deadline.
  bool Start(const std::string& unix_target, const std::string& job,
             const std::string& doorbell_fd_token, const std::string& doorbell_shm_name = "");
  std::unique_ptr<v1::GradSync::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TrainerRequest, v1::TrainerEvent>> stream;
};

/// A TCP port of 127.0.0.1 free a moment ago (-1 when none could be had).
int FreeLoopbackPort();

/// Hands `fd` to the daemon serving `socket_path` over its fd channel; the one-time token.
absl::StatusOr<std::string> ShareFd(const std::string& socket_path, int fd);

class DaemonProcess {
 public:
  /// The cluster token of test daemons that listen on TCP (shared, so they can form jobs).
  static constexpr char kTestToken[] = "gradsync-test-token";

  struct Options {
    std::vector<std::string> flags;                  // extra gradsyncd flags
    absl::Duration watchdog = absl::ZeroDuration();  // WATCHDOG_USEC when positive
    bool tcp = true;  // TCP needs a cluster token: kTestToken, unless flags name a --token_file
    std::vector<std::string> wrapper;  // argv prefix, e.g. {"/usr/sbin/ip", "netns", "exec", "n"}
    absl::Duration ready_timeout = absl::Seconds(20);
    std::string stderr_path;  // the daemon's log goes here when set (else the test's stderr)
  };

  /// Starts gradsyncd in `dir` (socket `dir`/gradsyncd.sock) and waits for READY=1.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const std::string& dir,
                                                              Options options);
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const std::string& dir) {
    return Start(dir, Options());
  }
  ~DaemonProcess();  // SIGKILL if still running

  /// Sends `signo` and waits for exit; returns the exit code.
  absl::StatusOr<int> Stop(int signo, absl::Duration timeout = absl::Seconds(20));

  pid_t pid() const { return pid_; }
  const std::string& socket_path() const { return socket_path_; }
  std::string unix_target() const { return "unix:" + socket_path_; }
  std::string tcp_target() const { return "127.0.0.1:" + std::to_string(tcp_port_); }
  int tcp_port() const { return tcp_port_; }
  /// The token TCP calls must carry: kTestToken, or "" when the test passed its own
  /// --token_file (or TCP is off).
  const std::string& token() const { return token_; }
  /// A file holding token(), for client processes (GRADSYNC_TOKEN_FILE); "" without one.
  const std::string& token_file() const { return token_file_; }

  /// Every sd_notify datagram received so far, in order.
  std::vector<std::string> Notifications();
  /// Waits until a notification containing `needle` arrives; false at `timeout`.
  bool WaitForNotification(const std::string& needle, absl::Duration timeout);
  /// Number of notifications containing `needle`.
  int CountNotifications(const std::string& needle);

 private:
  DaemonProcess() = default;
  void ReadNotifications();

  pid_t pid_ = -1;
  bool exited_ = false;
  int notify_fd_ = -1;
  int stop_pipe_[2] = {-1, -1};
  std::string socket_path_;
  int tcp_port_ = -1;
  std::string token_, token_file_;
  std::thread reader_;
  absl::Mutex mu_;
  std::vector<std::string> notifications_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradsync::testing
