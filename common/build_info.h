#pragma once

// The version line that --version prints.

#include <string>

namespace gradsync {

/// "gradsync 0.1.0 (cuda 13.0, nccl 2.28.x)" or "gradsync 0.1.0 (cuda off)": what --version prints.
std::string BuildInfo();

}  // namespace gradsync
