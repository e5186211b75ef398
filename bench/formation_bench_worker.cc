// One trainer of the formation benchmark (bench/formation_bench.py drives it).
//
//   formation_bench_worker TARGET JOB WORLD RANK ROOT
//
// Registers as rank RANK of WORLD, the only rank on its daemon (ROOT: the root daemon's
// host:port, "-" for none, as on etcd), then runs one barrier across the job, which waits for
// the job to form across every daemon. Prints "registered NS barrier NS" (unix nanoseconds).

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/time/clock.h"
#include "client/gradsync_client.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: formation_bench_worker TARGET JOB WORLD RANK ROOT\n");
    return 2;
  }
  const std::string root = argv[5];
  const int world = std::atoi(argv[3]), rank = std::atoi(argv[4]);
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
  // Stay a moment: a rank that leaves the job while another still finishes the same barrier
  // can fail that one ("lost: the connection was closed"), which is not what this measures.
  absl::SleepFor(absl::Milliseconds(500));
  return 0;
}
