// Implementation of tls.h: reads and checks the three PEM files, with a size cap and, for the
// key, the same file-mode check as the token file.

#include "common/tls.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace gradsync {
namespace {

// The largest certificate chain or key we read: far above any real one, so a wrong path (a
// device, a huge file) fails fast instead of filling memory.
constexpr std::streamsize kMaxPemBytes = 1 << 20;

// The whole file, which must hold a PEM block whose label ends with `label` ("CERTIFICATE",
// "PRIVATE KEY"). `secret`: refused when "others" have any access, like the token file.
absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path,
                                    absl::string_view label, bool secret) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(flag, "=", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, "=", path, " is not a regular file"));
  }
  if (secret && (st.st_mode & S_IRWXO) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", path, " is accessible to others; chmod o-rwx it"));
  }
  if (st.st_size > kMaxPemBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", path, " is larger than ", kMaxPemBytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text_stream;
  if (!in) return absl::FailedPreconditionError(absl::StrCat(flag, "=", path, " cannot be read"));
  text_stream << in.rdbuf();  // an empty file reads as "", refused below as holding no PEM
  const std::string text = text_stream.str();
  // "-----BEGIN CERTIFICATE-----", "-----BEGIN EC PRIVATE KEY-----", ...
  constexpr absl::string_view kBegin = "-----BEGIN ";
  const absl::string_view pem(text);
  const size_t begin = pem.find(kBegin);
  const size_t end = begin == pem.npos ? begin : pem.find("-----", begin + kBegin.size());
  if (end == pem.npos || !absl::EndsWith(pem.substr(begin, end - begin), label)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", path, " holds no PEM ", label, " block"));
  }
  return text;
}

}  // namespace

absl::StatusOr<std::optional<TlsPem>> ReadTlsFiles(const TlsFiles& files) {
  std::vector<std::string> missing;
  if (files.cert.empty()) missing.push_back("--tls_cert");
  if (files.key.empty()) missing.push_back("--tls_key");
  if (files.ca.empty()) missing.push_back("--tls_ca");
  if (missing.size() == 3) return std::nullopt;
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert, --tls_key and --tls_ca go together (all three or none); missing ",
                     absl::StrJoin(missing, ", ")));
  }
  TlsPem pem;
  auto cert = ReadPem("--tls_cert", files.cert, "CERTIFICATE", /*secret=*/false);
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("--tls_key", files.key, "PRIVATE KEY", /*secret=*/true);
  if (!key.ok()) return key.status();
  auto ca = ReadPem("--tls_ca", files.ca, "CERTIFICATE", /*secret=*/false);
  if (!ca.ok()) return ca.status();
  pem.cert_chain = *std::move(cert);
  pem.private_key = *std::move(key);
  pem.ca = *std::move(ca);
  return std::optional<TlsPem>(std::move(pem));
}

}  // namespace gradsync
