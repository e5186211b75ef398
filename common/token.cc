// Implementation of token.h: reads the token file, refusing an empty one or one that others
// may access.

#include "common/token.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace gradsync {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("token file ", path, ": ", std::strerror(errno)));
  }
  if ((st.st_mode & S_IRWXO) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("token file ", path, " is accessible to others; chmod o-rwx it"));
  }
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::FailedPreconditionError(absl::StrCat("token file ", path, " cannot be read"));
  }
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("token file ", path, " is empty"));
  }
  return token;
}

std::string ClientCredentialOf(absl::string_view token) {
  if (token.empty()) return "";
  static constexpr char kLabel[] = "gradsync client credential v1";
  unsigned char mac[32];
  size_t len = 0;
  if (::EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, token.data(), token.size(),
                  reinterpret_cast<const unsigned char*>(kLabel), sizeof(kLabel) - 1, mac,
                  sizeof(mac), &len) == nullptr ||
      len != sizeof(mac)) {
    return "";  // OpenSSL failed: no credential, so no client is let in by one
  }
  return absl::StrCat(kClientCredentialPrefix,
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(mac), len)));
}

}  // namespace gradsync
