// One client process of the store benchmark (bench/store_bench.py drives it).
//
//   store_bench_worker TARGET JOB OP SECONDS CLIENTS
//
// GRADSYNC_TOKEN_FILE names the cluster token file, for a TCP target.
//
// Connects, joins the start barrier (Add "ready", then waits for "go"), runs OP (set|get|add)
// back to back for SECONDS, and prints "ops N seconds S p50_us P p99_us Q" (the latency of one
// call, median and 99th percentile).

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "common/token.h"

int main(int argc, char** argv) {
  double seconds = 0;
  if (argc != 6 || !absl::SimpleAtod(argv[4], &seconds) || seconds <= 0 || seconds > 60) {
    std::cerr << "usage: store_bench_worker TARGET JOB set|get|add SECONDS CLIENTS\n";
    return 2;
  }
  const std::string job = argv[2], op = argv[3];
  if (op != "set" && op != "get" && op != "add") return 2;
  auto fail = [](const absl::Status& s) {
    std::cerr << "store_bench_worker: " << s << "\n";
    return 1;
  };
  gradsync::client::ClientOptions options;
  if (const char* path = std::getenv("GRADSYNC_TOKEN_FILE"); path != nullptr && *path) {
    auto token = gradsync::ReadTokenFile(path);
    if (!token.ok()) return fail(token.status());
    options.token = *std::move(token);
  }
  gradsync::client::StoreClient store(gradsync::client::Connect(argv[1], options), options);
  const std::string key = absl::StrCat("bench/", ::getpid());
  if (absl::Status s = store.Set(job, key, "value"); !s.ok()) return fail(s);
  if (auto r = store.Add(job, "ready", 1); !r.ok()) return fail(r.status());
  if (auto go = store.Get(job, "go", absl::Now() + absl::Seconds(120)); !go.ok()) {
    return fail(go.status());
  }
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  int64_t ops = 0;
  std::vector<int64_t> latency_ns;
  latency_ns.reserve(1 << 20);
  while (absl::Now() < end) {
    const int64_t begun = absl::GetCurrentTimeNanos();
    absl::Status s;
    if (op == "set") {
      s = store.Set(job, key, "value");
    } else if (op == "get") {
      s = store.Get(job, key, absl::Now() + absl::Seconds(5)).status();
    } else {
      s = store.Add(job, absl::StrCat(key, "/n"), 1).status();
    }
    if (!s.ok()) return fail(s);
    latency_ns.push_back(absl::GetCurrentTimeNanos() - begun);
    ++ops;
  }
  const double took = absl::ToDoubleSeconds(absl::Now() - start);
  std::sort(latency_ns.begin(), latency_ns.end());
  auto percentile_us = [&](double p) {
    if (latency_ns.empty()) return 0.0;
    return latency_ns[static_cast<size_t>(p * (latency_ns.size() - 1))] / 1000.0;
  };
  std::cout << "ops " << ops << " seconds " << took << " p50_us " << percentile_us(0.5)
            << " p99_us " << percentile_us(0.99) << "\n";
  return 0;
}
