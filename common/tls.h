#pragma once

// Reads the PEM files of a node's mutual-TLS identity (--tls_cert, --tls_key, --tls_ca).

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace gradsync {

/// A node's identity for mutual TLS between daemons (and tools reaching them over TCP), as PEM
/// text: its certificate (chain) and key, presented to peers, and the CA that every daemon's and
/// tool's certificate must chain to, against which peers are verified.
struct TlsPem {
  std::string cert_chain;
  std::string private_key;
  std::string ca;
};

/// The paths of the --tls_cert, --tls_key and --tls_ca flags (gradsyncd and gradsyncctl alike).
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
};

/// Reads the three files. nullopt when no path is set (TLS off). InvalidArgument when only some
/// are set (naming the missing flags); FailedPrecondition when a file cannot be read, holds no
/// PEM block of its kind, or, for the key, grants any access to "others" (chmod 600 or 640, as
/// the token file).
absl::StatusOr<std::optional<TlsPem>> ReadTlsFiles(const TlsFiles& files);

}  // namespace gradsync
