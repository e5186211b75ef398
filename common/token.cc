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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/job_id.h"

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

bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

std::string CredentialJob(absl::string_view job) {
  const size_t dot = job.rfind(".e");
  int epoch = 0;
  if (dot != absl::string_view::npos && dot > 0 && absl::SimpleAtoi(job.substr(dot + 2), &epoch) &&
      epoch > 0 && job.substr(dot + 2) == absl::StrCat(epoch)) {
    return std::string(job.substr(0, dot));
  }
  return std::string(job);
}

std::string ClientCredentialOf(absl::string_view token, absl::string_view job) {
  if (token.empty()) return "";
  const std::string scope = CredentialJob(job);
  const std::string label =
      absl::StrCat("gradsync client credential v1", std::string(1, '\0'), scope);
  unsigned char mac[32];
  size_t len = 0;
  if (::EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, token.data(), token.size(),
                  reinterpret_cast<const unsigned char*>(label.data()), label.size(), mac,
                  sizeof(mac), &len) == nullptr ||
      len != sizeof(mac)) {
    return "";  // OpenSSL failed: no credential, so no client is let in by one
  }
  return absl::StrCat(kClientCredentialPrefix, scope, ".",
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(mac), len)));
}

std::optional<std::string> VerifyClientCredential(absl::string_view token,
                                                  absl::string_view credential) {
  if (token.empty() || !absl::ConsumePrefix(&credential, kClientCredentialPrefix)) {
    return std::nullopt;
  }
  const size_t dot = credential.rfind('.');
  if (dot == absl::string_view::npos) return std::nullopt;
  const absl::string_view job = credential.substr(0, dot);
  if (!CheckJobId(job).ok() || CredentialJob(job) != job) return std::nullopt;
  const std::string want = ClientCredentialOf(token, job);
  if (want.empty() || !SameSecret(absl::StrCat(kClientCredentialPrefix, credential), want)) {
    return std::nullopt;
  }
  return std::string(job);
}

}  // namespace gradsync
