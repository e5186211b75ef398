// One rank of the gradsync collective benchmark (driven by bench/collective_bench.py): float32
// all-reduce (sum) through the local gradsyncd over shared memory, per size; then 200 x 40 KiB
// gradients as 200 async ops and as one fused op. Rank 0 prints JSON lines:
//   {"impl":"gradsync","case":"allreduce","ranks":N,"bytes":B,"iters":I,"median_us":..,...}
// Every rank runs the same iteration count (rank 0 picks it from a timed warm-up and
// broadcasts it), so the loop is bounded by --max_iters and about --seconds per size.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/gradsync_client.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "gradsyncd socket");
ABSL_FLAG(std::string, job, "bench", "job id");
ABSL_FLAG(int, world_size, 2, "ranks");
ABSL_FLAG(int, rank, 0, "this rank");
ABSL_FLAG(std::string, sizes, "4096,67108864", "bytes per all-reduce, comma separated");
ABSL_FLAG(int, min_iters, 5, "fewest timed iterations per size");
ABSL_FLAG(int, max_iters, 200, "most timed iterations per size");
ABSL_FLAG(double, seconds, 2.0, "target time per size");
ABSL_FLAG(int, local_world_size, 0, "ranks on this node (0: all); a smaller value spans daemons");
ABSL_FLAG(std::string, root_address, "", "host:port of rank 0's daemon (jobs spanning daemons)");
ABSL_FLAG(bool, elastic, false,
          "an elastic job (its cross-node ops write members only on success)");

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "rank %d: %s: %s\n", absl::GetFlag(FLAGS_rank), what.c_str(),
               s.ToString().c_str());
  std::exit(1);
}

void Report(const char* kind, int ranks, int64_t bytes, std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  auto pct = [&](double p) {
    return samples[std::min(samples.size() - 1, static_cast<size_t>(p * samples.size()))];
  };
  std::printf(
      "{\"impl\":\"gradsync\",\"case\":\"%s\",\"ranks\":%d,\"bytes\":%lld,\"iters\":%zu,"
      "\"median_us\":%.2f,\"p10_us\":%.2f,\"p90_us\":%.2f}\n",
      kind, ranks, static_cast<long long>(bytes), samples.size(), pct(0.5), pct(0.1), pct(0.9));
  std::fflush(stdout);
}

int Main() {
  const int world = absl::GetFlag(FLAGS_world_size), rank = absl::GetFlag(FLAGS_rank);
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(s, &v) && v >= 4) sizes.push_back(v);
  }
  constexpr int kGrads = 200;
  constexpr int64_t kGradBytes = 40 * 1024;
  int64_t max_bytes = kGrads * kGradBytes;
  for (int64_t s : sizes) max_bytes = std::max(max_bytes, s);

  const int local_world =
      absl::GetFlag(FLAGS_local_world_size) > 0 ? absl::GetFlag(FLAGS_local_world_size) : world;
  client::Placement placement{
      absl::GetFlag(FLAGS_job), world,       rank,
      rank % local_world,       local_world, absl::GetFlag(FLAGS_root_address)};
  placement.elastic = absl::GetFlag(FLAGS_elastic);
  auto c = client::Client::Connect(absl::GetFlag(FLAGS_socket), placement);
  if (!c.ok()) Die("connect", c.status());
  client::Client& client = **c;
  auto data = client.CreateBuffer(max_bytes, v1::FLOAT32);
  if (!data.ok()) Die("buffer", data.status());
  auto ctl = client.CreateBuffer(8, v1::INT64);
  if (!ctl.ok()) Die("buffer", ctl.status());
  float* x = reinterpret_cast<float*>((*data)->data());
  const uint64_t id = (*data)->id();
  int64_t* iters_slot = reinterpret_cast<int64_t*>((*ctl)->data());

  // Same count on every rank: rank 0 times `warmup` and broadcasts the count.
  auto agree_iters = [&](const std::function<absl::Status()>& once) {
    const auto t0 = Clock::now();
    for (int i = 0; i < 2; ++i) {
      if (absl::Status s = once(); !s.ok()) Die("warm-up", s);
    }
    const double each = std::max(1.0, Us(Clock::now() - t0) / 2);
    *iters_slot =
        std::clamp<int64_t>(static_cast<int64_t>(absl::GetFlag(FLAGS_seconds) * 1e6 / each),
                            absl::GetFlag(FLAGS_min_iters), absl::GetFlag(FLAGS_max_iters));
    if (absl::Status s = client.Broadcast(v1::INT64, 0, {{(*ctl)->id(), 0, 1}}); !s.ok()) {
      Die("broadcast", s);
    }
    return *iters_slot;
  };
  auto timed = [&](const std::function<absl::Status()>& once) {
    const int64_t iters = agree_iters(once);
    std::vector<double> samples;
    for (int64_t i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      if (absl::Status s = once(); !s.ok()) Die("op", s);
      samples.push_back(Us(Clock::now() - t0));
    }
    return samples;
  };

  for (int64_t bytes : sizes) {
    const int64_t n = bytes / 4;
    // One checked run with real values, then zeros (the sum of zeros stays finite).
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(rank + 1);
    if (absl::Status s = client.AllReduce(v1::FLOAT32, v1::SUM, {{id, 0, n}}); !s.ok())
      Die("check", s);
    const float want = world * (world + 1) / 2.0f;
    if (x[0] != want || x[n - 1] != want) {
      std::fprintf(stderr, "wrong result %g != %g\n", x[0], want);
      return 1;
    }
    std::fill(x, x + n, 0.0f);
    auto samples = timed([&] { return client.AllReduce(v1::FLOAT32, v1::SUM, {{id, 0, n}}); });
    if (rank == 0) Report("allreduce", world, bytes, samples);
  }

  std::fill(x, x + kGrads * kGradBytes / 4, 0.0f);
  std::vector<client::Segment> grads;
  for (int g = 0; g < kGrads; ++g) grads.push_back({id, g * kGradBytes, kGradBytes / 4});
  auto each = timed([&] {
    std::vector<client::Op> ops;
    for (const client::Segment& s : grads)
      ops.push_back(client.AllReduceAsync(v1::FLOAT32, v1::SUM, {s}));
    absl::Status status;
    for (client::Op& op : ops) status.Update(op.Wait());
    return status;
  });
  if (rank == 0) Report("grads200_each", world, kGrads * kGradBytes, each);
  auto fused = timed([&] { return client.AllReduce(v1::FLOAT32, v1::SUM, grads); });
  if (rank == 0) Report("grads200_fused", world, kGrads * kGradBytes, fused);
  return 0;
}

}  // namespace
}  // namespace gradsync

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return gradsync::Main();
}
