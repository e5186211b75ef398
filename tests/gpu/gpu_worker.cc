// A GPU trainer process for tests/gpu: device buffers exported to the daemon through CUDA IPC.
//
//   gpu_worker TARGET JOB WORLD RANK SCENARIO [key=value...]
//     ops    (one rank) two buffers a, b in one cudaMalloc allocation (the daemon maps one
//            allocation for both). Every op runs as a trainer runs it: on a non-blocking
//            stream, a kernel writes the input (late: it runs after a 20 ms delay kernel,
//            over stale data), Ready(stream), the op, WaitDone(stream), a kernel checks the
//            result; one host synchronisation at the end. Value checks, out of place into an
//            output holding a sentinel, so that a daemon that wrote nothing, or read before
//            "ready", fails them: all_gather, reduce_scatter sum, mean (NCCL's PreMulSum
//            kernel) and max. The API has no out-of-place all_reduce or broadcast: those run
//            in place (sum, mean, max, broadcast) and their values, which one rank leaves
//            unchanged, are checked but cannot show that the daemon did anything.
//     hold   registers a buffer, prints "mapped", then sleeps (the test kills it)
//     once   one all-reduce with timeout_ms=T; prints "status CODE message"
//     fused  (any world; device=D per rank) a fused all-reduce (sum) of 3 segments, q = N/4
//            floats each but the last: a[0,q) and a[q,2q) (adjacent: one NCCL call on one
//            node) and b[q,3q) (another buffer), three times; each time the segments are
//            written late (after a delay kernel, over stale data) and every float of a and b
//            outside them holds a gap pattern. Checks every segment holds the sum of the
//            ranks' inputs and every gap is untouched. With one rank the sum leaves the
//            input as it is: what it shows then is the fused op accepted and run, and nothing
//            written outside the segments. Prints "ok fused segments=3 checks=K world=W".
//   keys: count=N (floats per buffer, default 1Mi), op_timeout_ms=T (each op's deadline,
//   default 20000), delay_us=U (default 20000), local_world_size=L, root=HOST:PORT,
//   device=D (the CUDA device, default 0).
// Prints "ok ..." on success; exit code 1 on any error or wrong value, with the reason.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/gradsync_client.h"
#include "tests/gpu/gpu_kernels.h"

using gradsync::client::Client;
using gradsync::client::CudaBuffer;
using gradsync::client::OpOptions;
using gradsync::testing::CheckSlot;
using gradsync::testing::Pattern;

namespace {

std::map<std::string, std::string> g_args;

std::string Arg(const std::string& key, const std::string& fallback) {
  auto it = g_args.find(key);
  return it == g_args.end() ? fallback : it->second;
}

[[noreturn]] void Die(const std::string& what) {
  // On stdout, which the tests read, and stderr, which reaches the test log.
  std::printf("gpu_worker: %s\n", what.c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "gpu_worker: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void Check(cudaError_t e, const std::string& call) {
  if (e != cudaSuccess) Die(absl::StrCat(call, ": ", cudaGetErrorString(e)));
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
}

// One op of the "ops" scenario and where its check lands.
struct Step {
  std::string name;
  bool out_of_place;  // a value check that fails when the daemon does nothing
  Pattern want;
};

// The "fused" scenario (see the top of this file).
int Fused(Client& client, CudaBuffer& a, CudaBuffer& b, float* a_data, float* b_data, int64_t n,
          int world, int rank, const OpOptions& options) {
  const int64_t q = n / 4;
  if (q < 1) Die("fused: count must be at least 4");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const int64_t delay_us = std::stoll(Arg("delay_us", "20000"));
  const Pattern stale{-1.0f, -1.0f, 13};
  const Pattern gap{-5555.0f, 0.0f, 1};
  // Rank r's segment k: base 3r + k + 1, step 0.5, period 251; the sum over the ranks is exact.
  auto input = [](int r, int k) { return Pattern{static_cast<float>(3 * r + k + 1), 0.5f, 251}; };
  auto sum = [&](int k) {
    Pattern p{0, 0, 251};
    for (int r = 0; r < world; ++r) {
      p.base += input(r, k).base;
      p.step += input(r, k).step;
    }
    return p;
  };
  struct Range {
    float* data;
    int64_t count;
    Pattern want;
    std::string what;
  };
  // The segments (client side and where they lie) and the gaps.
  const std::vector<gradsync::client::Segment> segments = {
      {a.id(), 0, q},
      {a.id(), static_cast<int64_t>(q * sizeof(float)), q},
      {b.id(), static_cast<int64_t>(q * sizeof(float)), 2 * q}};
  const std::vector<float*> seg_data = {a_data, a_data + q, b_data + q};
  std::vector<Range> checks;
  for (int k = 0; k < 3; ++k) {
    checks.push_back({seg_data[k], segments[k].count, sum(k), absl::StrCat("segment ", k)});
  }
  checks.push_back({a_data + 2 * q, n - 2 * q, gap, "a after the segments"});
  checks.push_back({b_data, q, gap, "b before its segment"});
  checks.push_back({b_data + 3 * q, n - 3 * q, gap, "b after its segment"});
  constexpr int kRounds = 3;
  const size_t slots_n = kRounds * checks.size();
  CheckSlot* slots = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&slots), slots_n * sizeof(CheckSlot)), "cudaMalloc");
  Check(cudaMemsetAsync(slots, 0, slots_n * sizeof(CheckSlot), stream), "cudaMemsetAsync");
  for (int round = 0; round < kRounds; ++round) {
    Check(gradsync::testing::LaunchFill(a_data, n, gap, stream), "fill a gap");
    Check(gradsync::testing::LaunchFill(b_data, n, gap, stream), "fill b gap");
    for (int k = 0; k < 3; ++k) {
      Check(gradsync::testing::LaunchFill(seg_data[k], segments[k].count, stale, stream),
            "fill stale");
    }
    Check(gradsync::testing::LaunchDelay(delay_us, stream), "delay");
    for (int k = 0; k < 3; ++k) {
      Check(gradsync::testing::LaunchFill(seg_data[k], segments[k].count, input(rank, k), stream),
            "fill input");
    }
    Check(a.Ready(stream), "ready a");
    Check(b.Ready(stream), "ready b");
    Check(client.AllReduce(gradsync::v1::FLOAT32, gradsync::v1::SUM, segments, options),
          absl::StrCat("fused all_reduce round ", round));
    Check(a.WaitDone(stream), "wait done a");
    Check(b.WaitDone(stream), "wait done b");
    for (size_t i = 0; i < checks.size(); ++i) {
      Check(gradsync::testing::LaunchCheck(checks[i].data, checks[i].count, checks[i].want,
                                           &slots[round * checks.size() + i], stream),
            "check");
    }
  }
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<CheckSlot> found(slots_n);
  Check(cudaMemcpy(found.data(), slots, slots_n * sizeof(CheckSlot), cudaMemcpyDeviceToHost),
        "cudaMemcpy results");
  std::string wrong;
  for (size_t i = 0; i < slots_n; ++i) {
    if (found[i].wrong == 0) continue;
    const Range& r = checks[i % checks.size()];
    absl::StrAppend(&wrong, wrong.empty() ? "" : "; ", "round ", i / checks.size(), " ", r.what,
                    ": ", found[i].wrong, " of ", r.count, " wrong, e.g. [", found[i].index,
                    "] = ", found[i].got);
  }
  if (!wrong.empty()) Die(wrong);
  cudaFree(slots);
  cudaStreamDestroy(stream);
  std::printf("ok fused segments=3 checks=%zu world=%d\n", slots_n, world);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) Die("usage: gpu_worker TARGET JOB WORLD RANK SCENARIO [key=value...]");
  for (int i = 6; i < argc; ++i) {
    std::string kv = argv[i];
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) g_args[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const int world = std::atoi(argv[3]), rank = std::atoi(argv[4]);
  const std::string scenario = argv[5];
  const int local_world = std::stoi(Arg("local_world_size", std::to_string(world)));
  gradsync::client::Placement placement{argv[2],     world,          rank, rank % local_world,
                                        local_world, Arg("root", "")};
  auto client = Client::Connect(argv[1], placement);
  Check(client.status(), "connect");
  Check(cudaSetDevice(std::stoi(Arg("device", "0"))), "cudaSetDevice");
  const int64_t n = std::stoll(Arg("count", "1048576"));
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  OpOptions options;
  options.timeout = absl::Milliseconds(std::stoi(Arg("op_timeout_ms", "20000")));
  float* alloc = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&alloc), 2 * bytes), "cudaMalloc");  // one allocation
  float* const a_data = alloc;
  float* const b_data = alloc + n;
  auto a =
      (*client)->RegisterCudaBuffer(a_data, static_cast<int64_t>(bytes), gradsync::v1::FLOAT32);
  Check(a.status(), "register a");
  auto b =
      (*client)->RegisterCudaBuffer(b_data, static_cast<int64_t>(bytes), gradsync::v1::FLOAT32);
  Check(b.status(), "register b");

  if (scenario == "hold") {
    std::printf("mapped\n");
    std::fflush(stdout);
    for (int i = 0; i < 600; ++i) ::usleep(100000);  // at most 60 s; the test kills it first
    return 0;
  }
  if (scenario == "once") {
    Check((*a)->Ready(), "ready");
    OpOptions o = options;
    o.timeout = absl::Milliseconds(std::stoi(Arg("timeout_ms", "3000")));
    absl::Status s =
        (*client)->AllReduce(gradsync::v1::FLOAT32, gradsync::v1::SUM, {{(*a)->id(), 0, n}}, o);
    std::printf("status %s %s\n", absl::StatusCodeToString(s.code()).c_str(),
                std::string(s.message()).c_str());
    return 0;
  }
  if (scenario == "fused")
    return Fused(**client, **a, **b, a_data, b_data, n, world, rank, options);
  if (scenario != "ops") Die("unknown scenario " + scenario);
  if (world != 1) {
    Die("the ops scenario runs one rank (NCCL puts one rank of a communicator per GPU)");
  }

  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const int64_t delay_us = std::stoll(Arg("delay_us", "20000"));
  const Pattern input{static_cast<float>(3 * rank + 1), 0.5f, 251};
  const Pattern stale{-1.0f, -1.0f, 13};      // the input before its kernel ran
  const Pattern sentinel{-7777.0f, 0.0f, 1};  // an output before the op
  constexpr int kMaxSteps = 16;
  CheckSlot* slots = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&slots), kMaxSteps * sizeof(CheckSlot)), "cudaMalloc");
  Check(cudaMemsetAsync(slots, 0, kMaxSteps * sizeof(CheckSlot), stream), "cudaMemsetAsync");
  std::vector<Step> steps;
  const gradsync::client::Segment whole_a{(*a)->id(), 0, n}, whole_b{(*b)->id(), 0, n};

  // Runs one op the way a trainer does, all on `stream`; `op` submits it and waits for the
  // daemon's answer (not for the GPU).
  auto run = [&](const std::string& name, bool out_of_place,
                 const std::function<absl::Status()>& op) {
    CudaBuffer& written = out_of_place ? **b : **a;
    Check(gradsync::testing::LaunchFill(a_data, n, stale, stream), name + ": fill stale");
    if (out_of_place) {
      Check(gradsync::testing::LaunchFill(b_data, n, sentinel, stream), name + ": fill sentinel");
    }
    Check(gradsync::testing::LaunchDelay(delay_us, stream), name + ": delay");
    Check(gradsync::testing::LaunchFill(a_data, n, input, stream), name + ": fill input");
    Check((*a)->Ready(stream), name + ": ready a");
    if (out_of_place) Check((*b)->Ready(stream), name + ": ready b");
    Check(op(), name);
    Check(written.WaitDone(stream), name + ": wait done");
    // One rank: every op leaves the input's values where it writes.
    Check(gradsync::testing::LaunchCheck(out_of_place ? b_data : a_data, n, input,
                                         &slots[steps.size()], stream),
          name + ": check");
    steps.push_back({name, out_of_place, input});
  };
  using gradsync::v1::FLOAT32;
  run("all_gather", true,
      [&] { return (*client)->AllGatherAsync(FLOAT32, {whole_a}, {whole_b}, options).Wait(); });
  for (auto [op, label] : {std::pair{gradsync::v1::SUM, "sum"},
                           {gradsync::v1::MEAN, "mean"},
                           {gradsync::v1::MAX, "max"}}) {
    run(absl::StrCat("reduce_scatter(", label, ")"), true, [&, op = op] {
      return (*client)->ReduceScatterAsync(FLOAT32, op, {whole_a}, {whole_b}, options).Wait();
    });
  }
  for (auto [op, label] : {std::pair{gradsync::v1::SUM, "sum"},
                           {gradsync::v1::MEAN, "mean"},
                           {gradsync::v1::MAX, "max"}}) {
    run(absl::StrCat("all_reduce(", label, ") in place"), false,
        [&, op = op] { return (*client)->AllReduce(FLOAT32, op, {whole_a}, options); });
  }
  run("broadcast in place", false,
      [&] { return (*client)->Broadcast(FLOAT32, 0, {whole_a}, options); });

  // The one host synchronisation: every kernel and every daemon op above is done.
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<CheckSlot> found(steps.size());
  Check(cudaMemcpy(found.data(), slots, steps.size() * sizeof(CheckSlot), cudaMemcpyDeviceToHost),
        "cudaMemcpy results");
  int value_checks = 0, in_place = 0;
  std::string wrong;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (found[i].wrong != 0) {
      const float want =
          s.want.base + s.want.step * static_cast<float>(found[i].index % s.want.period);
      absl::StrAppend(&wrong, wrong.empty() ? "" : "; ", s.name, ": ", found[i].wrong, " of ", n,
                      " elements wrong, e.g. [", found[i].index, "] = ", found[i].got, " not ",
                      want, found[i].got == sentinel.base ? " (the sentinel: nothing written)" : "",
                      found[i].got == stale.base + stale.step * static_cast<float>(found[i].index %
                                                                                   stale.period)
                          ? " (the stale input: read before ready)"
                          : "");
    }
    ++(s.out_of_place ? value_checks : in_place);
  }
  if (!wrong.empty()) Die(wrong);
  Check((*client)->DestroyCudaBuffer(std::move(*a)), "destroy a");
  Check((*client)->DestroyCudaBuffer(std::move(*b)), "destroy b");
  cudaFree(slots);
  cudaStreamDestroy(stream);
  cudaFree(alloc);
  std::printf("ok value_checks=%d in_place=%d (in-place values cannot fail with one rank)\n",
              value_checks, in_place);
  return 0;
}
