#pragma once

// The project's one logging entry point: a named spdlog logger per component, sharing sinks.
// Messages carry key=value fields: Logger("store")->info("set job={} key={} bytes={}", ...).
// Nothing per-op at info level.

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace gradsync::logging {

/// Configures every logger, present and future. `level`: trace|debug|info|warn|error|off.
/// `sink`: "stderr", "journal", or "auto" (the journal when started by systemd, else stderr).
/// Call once at start-up, before threads that log exist.
absl::Status Init(absl::string_view level, absl::string_view sink);

/// The logger for `component`, created on first use. Thread-safe; the pointer lives forever.
std::shared_ptr<spdlog::logger> Logger(absl::string_view component);

}  // namespace gradsync::logging
