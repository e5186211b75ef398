// Implementation of gloo_store.h: Gloo's set, get and wait on the job's Store under a key
// prefix, with store errors thrown as gloo::IoException.

#include "daemon/backend/cpu/gloo_store.h"

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace gradsync::backend::cpu {
namespace {

[[noreturn]] void Throw(const absl::Status& status) {
  throw ::gloo::IoException(absl::StrCat("gradsync store: ", status.ToString()));
}

}  // namespace

GlooStore::GlooStore(gradsync::Store* store, std::string job, std::string prefix,
                     absl::Duration default_timeout)
    : store_(store),
      job_(std::move(job)),
      prefix_(std::move(prefix)),
      default_timeout_(default_timeout) {}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = store_->Set(job_, Key(key), std::string(data.begin(), data.end()));
  if (!s.ok()) Throw(s);
}

std::vector<char> GlooStore::get(const std::string& key) {
  auto values = store_->WaitBlocking(job_, {Key(key)}, absl::Now() + default_timeout_);
  if (!values.ok()) Throw(values.status());
  const std::string& v = values->front();
  return std::vector<char>(v.begin(), v.end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, absl::ToChronoMilliseconds(default_timeout_));
}

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& k : keys) full.push_back(Key(k));
  const absl::Duration limit = timeout.count() > 0 ? absl::FromChrono(timeout) : default_timeout_;
  auto values = store_->WaitBlocking(job_, std::move(full), absl::Now() + limit);
  if (!values.ok()) Throw(values.status());
}

}  // namespace gradsync::backend::cpu
