// One trainer of the formation benchmark (bench/formation_bench.py drives it).
//
//   formation_bench_worker TARGET JOB WORLD RANK ROOT [HOLD]
//
// Registers as rank RANK of WORLD, the only rank on its daemon (ROOT: the root daemon's
// host:port, "-" for none, as on etcd), then runs one barrier across the job, which waits for
// the job to form across every daemon. Prints "registered NS barrier NS" (unix nanoseconds).
//
// HOLD 1: then all-reduces 4 KiB (20 times) and 4 MiB (5 times) of float32 across the job,
// checking the sums, prints "allreduce 4096 US 4194304 US" (median microseconds) and "ready",
// and waits for a line on stdin: "go" runs one more barrier, which the benchmark has made
// impossible (it froze a daemon), and prints "failed NS" when it fails (unix nanoseconds);
// "end" (or stdin closed) leaves.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/gradsync_client.h"

namespace {

// Median microseconds of `iters` all-reduces of `bytes` (sums checked once).
double AllReduceUs(gradsync::client::Client& client, int world, int64_t bytes, int iters) {
  auto buffer = client.CreateBuffer(bytes, gradsync::v1::FLOAT32);
  if (!buffer.ok()) return -1;
  float* x = reinterpret_cast<float*>((*buffer)->data());
  const int64_t n = bytes / 4;
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    std::fill(x, x + n, 1.0f);
    const int64_t t0 = absl::GetCurrentTimeNanos();
    if (!client.AllReduce(gradsync::v1::FLOAT32, gradsync::v1::SUM, {(*buffer)->Whole(4)}).ok() ||
        x[0] != static_cast<float>(world) || x[n - 1] != static_cast<float>(world)) {
      return -1;
    }
    us.push_back((absl::GetCurrentTimeNanos() - t0) / 1e3);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: formation_bench_worker TARGET JOB WORLD RANK ROOT [HOLD]\n");
    return 2;
  }
  const std::string root = argv[5];
  const int world = std::atoi(argv[3]), rank = std::atoi(argv[4]);
  const bool hold = argc == 7 && std::string(argv[6]) == "1";
  gradsync::client::Placement placement{argv[2], world, rank, 0, 1, root == "-" ? "" : root};
  auto client = gradsync::client::Client::Connect(argv[1], placement);
  if (!client.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, client.status().ToString().c_str());
    return 1;
  }
  const int64_t registered = absl::GetCurrentTimeNanos();
  gradsync::client::OpOptions options;
  options.timeout = absl::Seconds(120);
  if (absl::Status s = (*client)->Barrier(options); !s.ok()) {
    std::fprintf(stderr, "rank %d barrier: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  std::printf("registered %lld barrier %lld\n", static_cast<long long>(registered),
              static_cast<long long>(absl::GetCurrentTimeNanos()));
  std::fflush(stdout);
  if (!hold) {
    // Stay a moment: a rank that leaves the job while another still finishes the same barrier
    // can fail that one ("lost: the connection was closed"), which is not what this measures.
    absl::SleepFor(absl::Milliseconds(500));
    return 0;
  }
  const double small = AllReduceUs(**client, world, 4096, 20);
  const double large = AllReduceUs(**client, world, 4 << 20, 5);
  if (small < 0 || large < 0) {
    std::fprintf(stderr, "rank %d: an all-reduce failed or summed wrong\n", rank);
    return 1;
  }
  std::printf("allreduce 4096 %.0f 4194304 %.0f\nready\n", small, large);
  std::fflush(stdout);
  std::string line;
  if (!std::getline(std::cin, line) || line != "go") return 0;
  options.timeout = absl::Seconds(60);
  const absl::Status s = (*client)->Barrier(options);
  std::printf("%s %lld\n", s.ok() ? "passed" : "failed",
              static_cast<long long>(absl::GetCurrentTimeNanos()));
  std::fflush(stdout);
  return 0;
}
