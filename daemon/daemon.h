#pragma once

// gradsyncd's process lifecycle: serve until SIGTERM or SIGINT, talk to systemd, then drain.

#include "daemon/config.h"

namespace gradsync::daemon {

/// Runs gradsyncd until SIGTERM or SIGINT: serves, tells systemd READY=1 (and WATCHDOG=1 as
/// often as WATCHDOG_USEC asks), then drains within config.drain_grace. Returns the exit code:
/// 0 after a clean drain, 1 if the servers could not start. SIGTERM and SIGINT must already be
/// blocked in every thread (BlockStopSignals, before any thread exists).
int RunDaemon(const DaemonConfig& config);

/// Blocks SIGTERM/SIGINT for the calling thread and the threads it starts later; ignores SIGPIPE.
void BlockStopSignals();

}  // namespace gradsync::daemon
