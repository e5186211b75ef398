#pragma once

// The project's one logging entry point: a named spdlog logger per component, sharing sinks.
// Messages carry key=value fields: Logger("store")->info("set job={} key={} bytes={}", ...).
// Nothing per-op at info level. Values come from clients (job ids, keys, reasons): every sink
// escapes control characters and backslashes in the message (a newline becomes "\n"), so no
// value can forge a log line or a journal field.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace gradsync::logging {

/// Configures every logger, present and future. `level`: trace|debug|info|warn|error|off.
/// `sink`: "stderr", "journal", or "auto" (the journal when started by systemd, else stderr).
/// Call once at start-up, before threads that log exist.
absl::Status Init(absl::string_view level, absl::string_view sink);

/// `message` with '\\', control characters and DEL escaped as C escapes ("\n", "\x1b");
/// other bytes (UTF-8 included) unchanged. What every sink writes.
std::string EscapeForLog(absl::string_view message);

/// The logger for `component`, created on first use. Thread-safe; the pointer lives forever.
std::shared_ptr<spdlog::logger> Logger(absl::string_view component);

}  // namespace gradsync::logging
