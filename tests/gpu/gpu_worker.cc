// A GPU trainer process for tests/gpu: device buffers exported to the daemon through CUDA IPC.
//
//   gpu_worker TARGET JOB WORLD RANK SCENARIO [key=value...]
//     allreduce   two buffers in one cudaMalloc allocation (so the daemon maps one allocation
//                 for both); sum, mean and max on float32, a broadcast and (one rank) an
//                 out-of-place all-gather, each checked on the device result after WaitDone
//     hold        registers a buffer, prints "mapped", then sleeps (the test kills it)
//     once        one all-reduce with timeout_ms=T; prints "status CODE message"
// Prints "ok ..." on success; exit code 1 on any mismatch.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/gradsync_client.h"

using gradsync::client::Client;
using gradsync::client::OpOptions;

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

void Check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) Die(absl::StrCat(call, ": ", cudaGetErrorString(e)));
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
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
  Check(cudaSetDevice(0), "cudaSetDevice");
  const int64_t n = std::stoll(Arg("count", "1048576"));
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  float* alloc = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&alloc), 2 * bytes), "cudaMalloc");  // one allocation
  std::vector<float> host(static_cast<size_t>(n));
  auto a = (*client)->RegisterCudaBuffer(alloc, static_cast<int64_t>(bytes), gradsync::v1::FLOAT32);
  Check(a.status(), "register a");
  auto b =
      (*client)->RegisterCudaBuffer(alloc + n, static_cast<int64_t>(bytes), gradsync::v1::FLOAT32);
  Check(b.status(), "register b");

  if (scenario == "hold") {
    std::printf("mapped\n");
    std::fflush(stdout);
    for (int i = 0; i < 600; ++i) ::usleep(100000);  // at most 60 s; the test kills it first
    return 0;
  }
  if (scenario == "once") {
    Check((*a)->Ready(), "ready");
    OpOptions o;
    o.timeout = absl::Milliseconds(std::stoi(Arg("timeout_ms", "3000")));
    absl::Status s =
        (*client)->AllReduce(gradsync::v1::FLOAT32, gradsync::v1::SUM, {{(*a)->id(), 0, n}}, o);
    std::printf("status %s %s\n", absl::StatusCodeToString(s.code()).c_str(),
                std::string(s.message()).c_str());
    return 0;
  }
  // allreduce: rank r fills a[i] = r + i % 7 and b[i] = 2r; sum / mean / max across the world.
  auto fill = [&](float* dev, auto value) {
    for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = value(i);
    Check(cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  };
  auto expect = [&](float* dev, auto value, const std::string& what) {
    Check(cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    for (int64_t i = 0; i < n; ++i) {
      if (std::fabs(host[static_cast<size_t>(i)] - value(i)) > 1e-4f) {
        Die(absl::StrCat(what, ": element ", i, " is ", host[static_cast<size_t>(i)], " not ",
                         value(i)));
      }
    }
  };
  int checks = 0;
  float rank_sum = 0;
  for (int r = 0; r < world; ++r) rank_sum += static_cast<float>(r);
  for (auto op : {gradsync::v1::SUM, gradsync::v1::MEAN, gradsync::v1::MAX}) {
    fill(alloc, [&](int64_t i) { return static_cast<float>(rank + i % 7); });
    Check((*a)->Ready(), "ready");
    Check((*client)->AllReduce(gradsync::v1::FLOAT32, op, {{(*a)->id(), 0, n}}), "all_reduce");
    Check((*a)->WaitDone(), "wait done");
    Check(cudaDeviceSynchronize(), "sync");
    expect(
        alloc,
        [&](int64_t i) {
          const float base = static_cast<float>(i % 7);
          if (op == gradsync::v1::SUM) return base * world + rank_sum;
          if (op == gradsync::v1::MEAN) return base + rank_sum / world;
          return base + static_cast<float>(world - 1);
        },
        absl::StrCat("all_reduce op ", op));
    ++checks;
  }
  fill(alloc + n, [&](int64_t) { return static_cast<float>(2 * rank + 1); });
  Check((*b)->Ready(), "ready b");
  Check((*client)->Broadcast(gradsync::v1::FLOAT32, world - 1, {{(*b)->id(), 0, n}}), "broadcast");
  Check((*b)->WaitDone(), "wait done b");
  Check(cudaDeviceSynchronize(), "sync");
  expect(
      alloc + n, [&](int64_t) { return static_cast<float>(2 * (world - 1) + 1); }, "broadcast");
  ++checks;
  // Out of place, so a daemon that wrote nothing cannot pass (with one rank the in-place ops
  // above leave a correct buffer unchanged): all-gather a into b, b holding a sentinel first.
  fill(alloc, [&](int64_t i) { return static_cast<float>(3 * rank + i % 5); });
  fill(alloc + n, [&](int64_t) { return -1.0f; });
  if (world == 1) {
    Check((*a)->Ready(), "ready a");
    Check((*b)->Ready(), "ready b");
    Check((*client)
              ->AllGatherAsync(gradsync::v1::FLOAT32, {{(*a)->id(), 0, n}}, {{(*b)->id(), 0, n}})
              .Wait(),
          "all_gather");
    Check((*b)->WaitDone(), "wait done b");
    Check(cudaDeviceSynchronize(), "sync");
    expect(
        alloc + n, [&](int64_t i) { return static_cast<float>(i % 5); }, "all_gather");
    ++checks;
  }
  Check((*client)->DestroyCudaBuffer(std::move(*a)), "destroy a");
  Check((*client)->DestroyCudaBuffer(std::move(*b)), "destroy b");
  cudaFree(alloc);
  std::printf("ok checks=%d\n", checks);
  return 0;
}
