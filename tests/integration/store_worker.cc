// A separate client process for the integration tests: runs store operations against a daemon
// and prints what it saw, so tests can check results across real processes.
//
//   store_worker TARGET JOB add KEY COUNT          COUNT x Add(KEY, 1); prints the last value
//   store_worker TARGET JOB setpacklist GROUP      stores SamplePlan() as the group's plan
//   store_worker TARGET JOB getpacklist GROUP MS   waits up to MS ms; prints the plan (text format)
//
// GRADSYNC_TOKEN_FILE names the cluster token file, for a TCP target.

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "common/token.h"
#include "google/protobuf/text_format.h"
#include "tests/integration/sample_plan.h"

namespace {

int Fail(const absl::Status& s) {
  std::cerr << "store_worker: " << s << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: store_worker TARGET JOB add|setpacklist|getpacklist ARGS...\n";
    return 2;
  }
  const std::string target = argv[1], job = argv[2], op = argv[3], arg = argv[4];
  // Over TCP the daemon wants the cluster token, read as gradsyncd reads it.
  gradsync::client::ClientOptions options;
  if (const char* path = std::getenv("GRADSYNC_TOKEN_FILE"); path != nullptr && *path) {
    auto token = gradsync::ReadTokenFile(path);
    if (!token.ok()) return Fail(token.status());
    options.token = *std::move(token);
  }
  gradsync::client::StoreClient store(gradsync::client::Connect(target, options), options);
  if (op == "add" && argc == 6) {
    int count = 0;
    if (!absl::SimpleAtoi(argv[5], &count)) return 2;
    int64_t last = 0;
    for (int i = 0; i < count; ++i) {
      auto v = store.Add(job, arg, 1);
      if (!v.ok()) return Fail(v.status());
      last = *v;
    }
    std::cout << last << "\n";
    return 0;
  }
  if (op == "setpacklist") {
    auto plan = gradsync::testing::SamplePlan();
    if (!plan.ok()) return Fail(plan.status());
    if (absl::Status s = store.SetPackList(job, arg, *plan); !s.ok()) return Fail(s);
    return 0;
  }
  if (op == "getpacklist" && argc == 6) {
    int ms = 0;
    if (!absl::SimpleAtoi(argv[5], &ms)) return 2;
    auto plan = store.GetPackList(job, arg, absl::Now() + absl::Milliseconds(ms));
    if (!plan.ok()) return Fail(plan.status());
    std::string text;
    google::protobuf::TextFormat::PrintToString(*plan, &text);
    std::cout << text;
    return 0;
  }
  std::cerr << "store_worker: bad arguments\n";
  return 2;
}
