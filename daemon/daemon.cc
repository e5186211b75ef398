// Implementation of daemon.h: signal handling, systemd readiness and watchdog notifications,
// and the start, wait and drain sequence of gradsyncd.

#include "daemon/daemon.h"

#include <signal.h>
#include <systemd/sd-daemon.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/build_info.h"
#include "common/logging.h"
#include "daemon/server.h"

namespace gradsync::daemon {
namespace {

auto Log() { return logging::Logger("daemon"); }

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// Sends a state to systemd's notify socket; a no-op when not started by systemd.
void Notify(const std::string& state) { sd_notify(0, state.c_str()); }

// Half the watchdog period systemd asked for, or none.
absl::Duration WatchdogPing() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) return absl::Microseconds(usec) / 2;
  return absl::InfiniteDuration();
}

}  // namespace

void BlockStopSignals() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t set = StopSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int RunDaemon(const DaemonConfig& config) {
  Log()->info("starting version=\"{}\" pid={}", BuildInfo(), ::getpid());
  DaemonServer server(config);
  if (absl::Status s = server.Start(); !s.ok()) {
    Log()->error("cannot start: {}", s.ToString());
    Notify(absl::StrCat("STATUS=failed: ", s.message()));
    return 1;
  }
  Notify(absl::StrCat("READY=1\nSTATUS=serving ", server.Endpoints()));

  const absl::Duration ping = WatchdogPing();
  if (ping != absl::InfiniteDuration()) {
    Log()->info("watchdog ping={}", absl::FormatDuration(ping));
    Notify("WATCHDOG=1");
  }
  const sigset_t stop = StopSignals();
  int signo = -1;
  while (signo < 0) {
    const absl::Duration wait = ping == absl::InfiniteDuration() ? absl::Seconds(3600) : ping;
    const timespec ts = absl::ToTimespec(wait);
    signo = sigtimedwait(&stop, nullptr, &ts);
    if (signo < 0 && errno == EAGAIN && ping != absl::InfiniteDuration()) Notify("WATCHDOG=1");
  }
  Log()->info("received signal={}; draining", strsignal(signo));
  Notify(absl::StrCat("STOPPING=1\nSTATUS=draining (", strsignal(signo), ")"));
  server.BeginDrain();
  server.Shutdown(config.drain_grace);
  Log()->info("exiting code=0");
  return 0;
}

}  // namespace gradsync::daemon
