#pragma once

// What the fuzz targets share: a check that aborts (so libFuzzer keeps the input that broke an
// invariant) and quiet logs (a run makes millions of calls; the sanitizers report, not the logs).

#include <cstdio>
#include <cstdlib>

#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"

/// Aborts with the failed condition and where it is when `cond` is false; never compiled out.
#define GRADSYNC_FUZZ_CHECK(cond)                                                            \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (false)

namespace gradsync::fuzz {

/// Call from LLVMFuzzerInitialize: daemon logs off, protobuf's parse errors unprinted.
inline void QuietLogs() {
  (void)logging::Init("off", "stderr");
  google::protobuf::SetLogHandler(nullptr);
}

}  // namespace gradsync::fuzz
