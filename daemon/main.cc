// gradsyncd: the per-node gradient-synchronisation daemon. Thin: flags, logging, run.

#include <iostream>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/synchronization/mutex.h"
#include "common/build_info.h"
#include "common/logging.h"
#include "daemon/config.h"
#include "daemon/config_doc.h"
#include "daemon/daemon.h"
#include "daemon/gpu/gpu_api.h"

ABSL_DECLARE_FLAG(std::string, print_config);

int main(int argc, char** argv) {
  gradsync::daemon::BlockStopSignals();  // before any thread exists
  gradsync::gpu::SetNcclDefaults();      // before any thread exists (setenv)
  // Debian's Abseil is built with Mutex deadlock detection on, which costs a graph update per
  // lock on every store call; our lock order is documented in the headers instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "gradsyncd: per-node gradient-synchronisation daemon.\n"
      "  gradsyncd [--flagfile=/etc/gradsync/gradsyncd.flags] [--socket=PATH] [--port=N] ...");
  absl::FlagsUsageConfig usage;
  usage.version_string = [] { return gradsync::BuildInfo() + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "gradsyncd: unexpected argument '" << rest[1] << "' (flags only; see --help)\n";
    return 2;
  }
  if (const std::string what = absl::GetFlag(FLAGS_print_config); !what.empty()) {
    auto text = what == "flagfile"   ? gradsync::daemon::RenderFlagfile()
                : what == "markdown" ? gradsync::daemon::RenderConfigurationPage()
                : what == "man"      ? gradsync::daemon::RenderManual()
                                     : absl::InvalidArgumentError("--print_config='" + what +
                                                                  "': flagfile, markdown or man");
    if (!text.ok()) {
      std::cerr << "gradsyncd: " << text.status().message() << "\n";
      return 2;
    }
    std::cout << *text;
    return 0;
  }
  auto config = gradsync::daemon::ConfigFromFlags();
  if (!config.ok()) {
    std::cerr << "gradsyncd: " << config.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = gradsync::logging::Init(config->log_level, config->log_sink); !s.ok()) {
    std::cerr << "gradsyncd: " << s.message() << "\n";
    return 2;
  }
  return gradsync::daemon::RunDaemon(*config);
}
