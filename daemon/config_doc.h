#pragma once

// The configuration's two documents, generated from gradsyncd's own flag definitions (config.cc)
// so that they cannot drift: the example flagfile (deploy/gradsyncd.flags) and the configuration
// page (docs/configuration.md). `gradsyncd --print_config=flagfile|markdown|man` prints them (and
// the manual page); a test compares the committed files with what the binary prints.

#include <string>

#include "absl/status/statusor.h"

namespace gradsync::daemon {

/// The flagfile: each section's text as comments, then every flag of the section as a comment
/// (its help) and a commented-out `--flag=default` line. FailedPrecondition when a flag of
/// config.cc is in no section, or a section names a flag that does not exist.
absl::StatusOr<std::string> RenderFlagfile();

/// The configuration page (Markdown): each section's text and a table of its flags (flag,
/// default, what it is for).
absl::StatusOr<std::string> RenderConfigurationPage();

/// The manual page gradsyncd(8), roff: each section's text and its flags.
absl::StatusOr<std::string> RenderManual();

}  // namespace gradsync::daemon
