// GPU collectives through gradsyncd (CUDA IPC buffers, events, the daemon's NCCL communicator)
// against the same NCCL collective called directly by this process on its own communicator,
// on the same buffers, same GPU, one rank, same run, interleaved op by op.
//
// One rank, so both paths must move every byte or they measure nothing: NCCL returns at once
// for a one-rank op that is neither out of place nor PreMulSum (ncclLaunchOneRank). Modes:
//   mean  in-place all_reduce with ncclAvg (MEAN): NCCL's PreMulSum kernel reads and writes
//         every element (x * 1/1)
//   copy  out-of-place all_gather: a device-to-device copy of every byte
// Per size and mode: median time per op (submit to result usable on this process's stream,
// host-synchronised), both paths, the ratio, the daemon's overhead and the memory bandwidth the
// direct path reached (read + write bytes per second: flat times across sizes would show here).
//
//   gpu_bench --socket=/path/gradsyncd.sock [--sizes=4096,...] [--modes=mean,copy] [--iters=20]
//             [--json=results.json] [--budget_s=120] [--init_timeout_s=60] [--op_timeout_ms=20000]
// Everything is bounded: NCCL's initialisation (non-blocking, polled), every daemon op (its own
// deadline), the whole run (sizes left once --budget_s is spent are listed as skipped). The JSON
// file is rewritten after every size, so a run cut short still leaves what it measured.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/gradsync_client.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "gradsyncd's unix socket");
ABSL_FLAG(std::string, sizes, "4096,65536,1048576,16777216,67108864,268435456,1073741824",
          "bytes of float32 per buffer");
ABSL_FLAG(std::string, modes, "mean,copy",
          "mean (in-place ncclAvg all_reduce), copy "
          "(out-of-place all_gather)");
ABSL_FLAG(int, iters, 20,
          "timed ops per size, mode and path (after 3 warm-up ops); fewer for "
          "sizes whose ops would exceed their share of --budget_s");
ABSL_FLAG(std::string, json, "", "where to write the results as JSON (rewritten after each size)");
ABSL_FLAG(int, budget_s, 120, "no new size is started past this many seconds");
ABSL_FLAG(int, init_timeout_s, 60, "bound on this process's NCCL communicator initialisation");
ABSL_FLAG(int, op_timeout_ms, 20000, "deadline of every op through the daemon");

namespace {

constexpr int64_t kBlock = int64_t{2} << 20;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what, int code = 1) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(code);
}
void Check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) Die(std::string(call) + ": " + cudaGetErrorString(e));
}

// A non-blocking communicator answers ncclInProgress while it works: wait (bounded) until it is
// done, as the daemon does.
void CheckNccl(ncclResult_t r, ncclComm_t comm, const char* call,
               std::chrono::seconds bound = std::chrono::seconds(60)) {
  const auto give_up = Clock::now() + bound;
  while (r == ncclInProgress) {
    if (Clock::now() > give_up) {
      Die(absl::StrCat(call, ": still in progress after ", bound.count(),
                       " s (NCCL initialisation stalled: see NCCL_DEBUG=INFO; run.sh retries "
                       "with NCCL_CUMEM_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1)"),
          3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) break;
    r = async;
  }
  if (r != ncclSuccess) {
    Die(absl::StrCat(call, ": ", ncclGetErrorString(r), ": ", ncclGetLastError(comm)));
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string Version(int v, int major_div, int minor_div) {  // 13000 -> "13.0"
  return absl::StrCat(v / major_div, ".", (v % major_div) / minor_div);
}

struct Row {
  std::string mode;
  int64_t bytes = 0;
  int iters = 0;
  double direct_us = 0, gradsync_us = 0, direct_min_us = 0, gradsync_min_us = 0;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const auto start = Clock::now();
  const auto budget = std::chrono::seconds(absl::GetFlag(FLAGS_budget_s));
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0 || v % 4 != 0) Die("bad --sizes");
    sizes.push_back(v);
  }
  std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& m : modes) {
    if (m != "mean" && m != "copy") Die("bad --modes: " + m);
  }
  const int max_iters = std::max(1, absl::GetFlag(FLAGS_iters));

  // What runs here, beside the numbers.
  int runtime = 0, driver = 0, nccl = 0;
  Check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
  Check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  if (ncclGetVersion(&nccl) != ncclSuccess) Die("ncclGetVersion failed");
  Check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::string versions =
      absl::StrFormat("device 0 %s (sm_%d%d), CUDA runtime %s, driver %s, NCCL %d.%d.%d", prop.name,
                      prop.major, prop.minor, Version(runtime, 1000, 10), Version(driver, 1000, 10),
                      nccl / 10000, (nccl % 10000) / 100, nccl % 100);
  std::printf("# gpu_bench, one rank: %s\n", versions.c_str());
  std::printf(
      "# mean: in-place all_reduce ncclAvg (PreMulSum kernel, every byte read and written)\n");
  std::printf("# copy: out-of-place all_gather (device copy of every byte)\n");
  std::fflush(stdout);

  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) Die("ncclGetUniqueId failed");
  ncclComm_t comm = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // polled below, bounded
  const auto init_start = Clock::now();
  CheckNccl(ncclCommInitRankConfig(&comm, 1, id, 0, &config), comm, "ncclCommInitRankConfig",
            std::chrono::seconds(absl::GetFlag(FLAGS_init_timeout_s)));
  const double init_s = std::chrono::duration<double>(Clock::now() - init_start).count();
  std::printf("# direct NCCL communicator ready in %.2f s\n", init_s);

  auto client = gradsync::client::Client::Connect(
      absl::GetFlag(FLAGS_socket), gradsync::client::Placement{"gpubench", 1, 0, 0, 1, ""});
  if (!client.ok()) Die("connect: " + client.status().ToString());
  gradsync::client::OpOptions options;
  options.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_op_timeout_ms));

  std::vector<Row> rows;
  std::vector<int64_t> skipped;
  auto write_json = [&](bool complete) {
    const std::string path = absl::GetFlag(FLAGS_json);
    if (path.empty()) return;
    std::string j = absl::StrFormat(
        "{\n  \"bench\": \"gpu_bench\",\n  \"ranks\": 1,\n  \"device\": \"%s\",\n"
        "  \"compute_capability\": \"%d.%d\",\n  \"cuda_runtime\": %d,\n  \"cuda_driver\": %d,\n"
        "  \"nccl\": %d,\n  \"nccl_init_s\": %.3f,\n  \"complete\": %s,\n  \"skipped_sizes\": "
        "[%s],\n"
        "  \"results\": [",
        prop.name, prop.major, prop.minor, runtime, driver, nccl, init_s,
        complete ? "true" : "false", absl::StrJoin(skipped, ", "));
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      absl::StrAppendFormat(
          &j,
          "%s\n    {\"mode\": \"%s\", \"bytes\": %d, \"iters\": %d, \"direct_us\": %.2f, "
          "\"gradsync_us\": %.2f, \"direct_min_us\": %.2f, \"gradsync_min_us\": %.2f, "
          "\"ratio\": %.4f, \"overhead_us\": %.2f, \"direct_GBps\": %.1f}",
          i ? "," : "", r.mode, r.bytes, r.iters, r.direct_us, r.gradsync_us, r.direct_min_us,
          r.gradsync_min_us, r.gradsync_us / r.direct_us, r.gradsync_us - r.direct_us,
          2.0 * static_cast<double>(r.bytes) / r.direct_us / 1e3);
    }
    j += "\n  ]\n}\n";
    if (FILE* f = std::fopen((path + ".tmp").c_str(), "w")) {
      std::fputs(j.c_str(), f);
      std::fclose(f);
      std::rename((path + ".tmp").c_str(), path.c_str());
    }
  };

  std::printf("%-5s %12s %6s %12s %12s %8s %12s %12s\n", "mode", "bytes", "iters", "direct_us",
              "gradsync_us", "ratio", "overhead_us", "direct_GBps");
  std::fflush(stdout);
  for (int64_t bytes : sizes) {
    const auto spent = Clock::now() - start;
    if (spent > budget) {
      skipped.push_back(bytes);
      continue;
    }
    const int64_t n = bytes / 4;
    // Whole 2 MiB blocks: CUDA IPC shares the block a small allocation lies in, and NVIDIA
    // advises sharing only allocations of a multiple of 2 MiB.
    const size_t block = static_cast<size_t>((bytes + kBlock - 1) / kBlock * kBlock);
    void* in = nullptr;
    void* out = nullptr;
    Check(cudaMalloc(&in, block), "cudaMalloc");
    Check(cudaMalloc(&out, block), "cudaMalloc");
    Check(cudaMemsetAsync(in, 0, block, stream), "cudaMemsetAsync");
    auto in_buf = (*client)->RegisterCudaBuffer(in, bytes, gradsync::v1::FLOAT32);
    if (!in_buf.ok()) Die("register: " + in_buf.status().ToString());
    auto out_buf = (*client)->RegisterCudaBuffer(out, bytes, gradsync::v1::FLOAT32);
    if (!out_buf.ok()) Die("register: " + out_buf.status().ToString());
    const gradsync::client::Segment whole_in{(*in_buf)->id(), 0, n},
        whole_out{(*out_buf)->id(), 0, n};
    for (const std::string& mode : modes) {
      const bool copy = mode == "copy";
      auto direct = [&] {
        CheckNccl(copy ? ncclAllGather(in, out, static_cast<size_t>(n), ncclFloat32, comm, stream)
                       : ncclAllReduce(in, in, static_cast<size_t>(n), ncclFloat32, ncclAvg, comm,
                                       stream),
                  comm, copy ? "ncclAllGather" : "ncclAllReduce");
        Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      };
      auto through_daemon = [&] {
        gradsync::client::CudaBuffer& written = copy ? **out_buf : **in_buf;
        if (absl::Status s = (*in_buf)->Ready(stream); !s.ok()) Die(s.ToString());
        if (copy) {
          if (absl::Status s = (*out_buf)->Ready(stream); !s.ok()) Die(s.ToString());
        }
        absl::Status s =
            copy ? (*client)
                       ->AllGatherAsync(gradsync::v1::FLOAT32, {whole_in}, {whole_out}, options)
                       .Wait()
                 : (*client)->AllReduce(gradsync::v1::FLOAT32, gradsync::v1::MEAN, {whole_in},
                                        options);
        if (!s.ok())
          Die(absl::StrCat(mode, " through gradsyncd, ", bytes, " bytes: ", s.ToString()));
        if (absl::Status w = written.WaitDone(stream); !w.ok()) Die(w.ToString());
        Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      };
      auto timed = [](const std::function<void()>& op) {
        const auto t0 = Clock::now();
        op();
        return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      };
      for (int i = 0; i < 3; ++i) {
        direct();
        through_daemon();
      }
      // Iterations: as asked, fewer where a pair of ops would overrun this size's share of the
      // remaining budget (at least 5).
      const double pair_us = timed(direct) + timed(through_daemon);
      const double left_us =
          std::chrono::duration<double, std::micro>(budget - (Clock::now() - start)).count();
      const double share_us = left_us / static_cast<double>(modes.size() * sizes.size());
      const int iters =
          std::max(5, std::min(max_iters, static_cast<int>(share_us / std::max(pair_us, 1.0))));
      std::vector<double> d, g;
      for (int i = 0; i < iters; ++i) {  // interleaved, so that drift hits both paths alike
        d.push_back(timed(direct));
        g.push_back(timed(through_daemon));
      }
      Row r{mode,
            bytes,
            iters,
            Median(d),
            Median(g),
            *std::min_element(d.begin(), d.end()),
            *std::min_element(g.begin(), g.end())};
      rows.push_back(r);
      std::printf("%-5s %12lld %6d %12.1f %12.1f %7.3fx %12.1f %12.1f\n", mode.c_str(),
                  static_cast<long long>(bytes), iters, r.direct_us, r.gradsync_us,
                  r.gradsync_us / r.direct_us, r.gradsync_us - r.direct_us,
                  2.0 * static_cast<double>(bytes) / r.direct_us / 1e3);
      std::fflush(stdout);
    }
    (void)(*client)->DestroyCudaBuffer(std::move(*in_buf));
    (void)(*client)->DestroyCudaBuffer(std::move(*out_buf));
    Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    cudaFree(in);
    cudaFree(out);
    write_json(false);
  }
  if (!skipped.empty()) {
    std::printf("# skipped (past --budget_s=%d): %s\n", absl::GetFlag(FLAGS_budget_s),
                absl::StrJoin(skipped, ",").c_str());
  }
  write_json(skipped.empty());
  ncclCommDestroy(comm);
  return 0;
}
