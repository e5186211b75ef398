// GPU all-reduce: through gradsyncd (CUDA IPC buffer, events, the daemon's NCCL communicator)
// against ncclAllReduce called directly by this process on its own communicator, same sizes,
// same GPU, one rank, same run. Per size: median time per op (submit to result usable on the
// trainer's stream), both paths, the ratio and the daemon's overhead.
//
//   gpu_bench --socket=/path/gradsyncd.sock [--sizes=4096,...] [--iters=50]
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/gradsync_client.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "gradsyncd's unix socket");
ABSL_FLAG(std::string, sizes, "4096,65536,1048576,16777216,67108864,268435456,1073741824",
          "bytes of float32");
ABSL_FLAG(int, iters, 50, "timed ops per size and path (after 5 warm-up ops)");

namespace {

constexpr int64_t kBlock = int64_t{2} << 20;

void Die(const std::string& what) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::exit(1);
}
void Check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) Die(std::string(call) + ": " + cudaGetErrorString(e));
}
void Check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) Die(std::string(call) + ": " + ncclGetErrorString(r));
}

template <typename F>
double MedianUs(int iters, F&& op) {
  for (int i = 0; i < 5; ++i) op();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    op();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                    .count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) Die("bad --sizes");
    sizes.push_back(v);
  }
  const int iters = absl::GetFlag(FLAGS_iters);
  Check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  ncclUniqueId id;
  Check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  ncclComm_t comm;
  Check(ncclCommInitRank(&comm, 1, id, 0), "ncclCommInitRank");
  auto client = gradsync::client::Client::Connect(
      absl::GetFlag(FLAGS_socket), gradsync::client::Placement{"gpubench", 1, 0, 0, 1, ""});
  if (!client.ok()) Die("connect: " + client.status().ToString());

  int nccl_version = 0;
  Check(ncclGetVersion(&nccl_version), "ncclGetVersion");
  std::printf("# nccl %d\n", nccl_version);
  std::printf("%12s %14s %14s %10s %12s\n", "bytes", "direct_us", "gradsync_us", "ratio",
              "overhead_us");
  for (int64_t bytes : sizes) {
    const int64_t n = bytes / 4;
    void* direct = nullptr;
    void* shared = nullptr;
    // Whole 2 MiB blocks: CUDA IPC shares the block a small allocation lies in, and NVIDIA
    // advises sharing only allocations of a multiple of 2 MiB.
    const size_t block = static_cast<size_t>((bytes + kBlock - 1) / kBlock * kBlock);
    Check(cudaMalloc(&direct, block), "cudaMalloc");
    Check(cudaMalloc(&shared, block), "cudaMalloc");
    auto buf = (*client)->RegisterCudaBuffer(shared, bytes, gradsync::v1::FLOAT32);
    if (!buf.ok()) Die("register: " + buf.status().ToString());
    const double d = MedianUs(iters, [&] {
      Check(
          ncclAllReduce(direct, direct, static_cast<size_t>(n), ncclFloat32, ncclSum, comm, stream),
          "ncclAllReduce");
      Check(cudaStreamSynchronize(stream), "sync");
    });
    const double g = MedianUs(iters, [&] {
      if (absl::Status s = (*buf)->Ready(stream); !s.ok()) Die(s.ToString());
      absl::Status s =
          (*client)->AllReduce(gradsync::v1::FLOAT32, gradsync::v1::SUM, {{(*buf)->id(), 0, n}});
      if (!s.ok()) Die("all_reduce: " + s.ToString());
      if (absl::Status w = (*buf)->WaitDone(stream); !w.ok()) Die(w.ToString());
      Check(cudaStreamSynchronize(stream), "sync");
    });
    std::printf("%12lld %14.1f %14.1f %9.3fx %12.1f\n", static_cast<long long>(bytes), d, g, g / d,
                g - d);
    std::fflush(stdout);
    (void)(*client)->DestroyCudaBuffer(std::move(*buf));
    cudaFree(direct);
    cudaFree(shared);
  }
  ncclCommDestroy(comm);
  return 0;
}
