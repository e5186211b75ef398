// membw: this machine's memory bandwidth, measured in the same run as the collective benchmarks
// (bench/collective_bench.py) so their results can be read against it.
//
//   copy: memcpy of one --bytes buffer into another (like STREAM copy), split across threads.
//   read: sum of the floats of one --bytes buffer, split across threads.
//
// Convention: GBps counts every byte read plus every byte written, per second, in 1e9 bytes:
// copy moves 2 * bytes per pass (read src + write dst; any write-allocate traffic is not
// counted), read moves 1 * bytes per pass. Each case takes the best of bounded repetitions
// (at least 3, at most 100, stopping after about --seconds).
//
// Usage: membw [--bytes 268435456] [--threads 2 | --threads 1,2] [--seconds 2]
// Prints per thread count: {"impl":"membw","case":"copy","threads":T,"bytes":B,"GBps":x}
//                          {"impl":"membw","case":"read","threads":T,"bytes":B,"GBps":x}
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

constexpr int kMinReps = 3;
constexpr int kMaxReps = 100;
constexpr size_t kAlign = 64;

struct Options {
  int64_t bytes = int64_t{256} << 20;
  std::vector<int> threads;
  double seconds = 2.0;
};

[[noreturn]] void Usage() {
  std::fprintf(stderr,
               "usage: membw [--bytes B] [--threads T[,T...]] [--seconds S]\n"
               "  B: size of each buffer (>= 1 MiB, multiple of 64); T: 1..256; S: 0..60\n");
  std::exit(2);
}

int64_t ParseInt(const std::string& s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > hi) Usage();
  return v;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      Usage();
    }
    if (arg == "--bytes") {
      o.bytes = ParseInt(value, int64_t{1} << 20, int64_t{1} << 40);
      if (o.bytes % kAlign != 0) Usage();
    } else if (arg == "--threads") {
      o.threads.clear();
      size_t start = 0;
      while (start <= value.size()) {
        size_t comma = value.find(',', start);
        if (comma == std::string::npos) comma = value.size();
        o.threads.push_back(static_cast<int>(ParseInt(value.substr(start, comma - start), 1, 256)));
        start = comma + 1;
      }
    } else if (arg == "--seconds") {
      char* end = nullptr;
      o.seconds = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(o.seconds > 0 && o.seconds <= 60)) Usage();
    } else {
      Usage();
    }
  }
  if (o.threads.empty()) o.threads.push_back(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

float* AllocBuffer(int64_t bytes) {
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "membw: cannot allocate %lld bytes\n", static_cast<long long>(bytes));
    std::exit(1);
  }
  return static_cast<float*>(p);
}

// Runs fn(thread, begin, end) over [0, bytes) split into `threads` 64-byte-aligned slices;
// returns the wall time from before the first thread starts to after the last one ends.
double Parallel(int threads, int64_t bytes, const std::function<void(int, int64_t, int64_t)>& fn) {
  int64_t chunk = (bytes / threads + kAlign - 1) / kAlign * kAlign;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    int64_t begin = std::min(bytes, t * chunk), end = std::min(bytes, begin + chunk);
    pool.emplace_back(fn, t, begin, end);
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Sums floats in 4 independent 4-lane accumulators so the loop is vectorized and not bound by
// add latency (no -ffast-math needed). n is a multiple of 16.
typedef float V4 __attribute__((vector_size(16)));
float SumFloats(const float* p, int64_t n) {
  V4 a = {0, 0, 0, 0}, b = a, c = a, d = a;
  for (int64_t i = 0; i < n; i += 16) {
    V4 x, y, z, w;
    std::memcpy(&x, p + i, sizeof(V4));
    std::memcpy(&y, p + i + 4, sizeof(V4));
    std::memcpy(&z, p + i + 8, sizeof(V4));
    std::memcpy(&w, p + i + 12, sizeof(V4));
    a += x;
    b += y;
    c += z;
    d += w;
  }
  V4 s = (a + b) + (c + d);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

volatile float g_sink;  // keeps the read loop's result alive

// Best GB/s over repetitions of one pass moving `moved` bytes.
template <typename Pass>
double Best(double seconds, int64_t moved, Pass pass) {
  double best = 0, spent = 0;
  for (int rep = 0; rep < kMaxReps && (rep < kMinReps || spent < seconds); ++rep) {
    double t = pass();
    spent += t;
    best = std::max(best, static_cast<double>(moved) / t / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = ParseOptions(argc, argv);
  float* src = AllocBuffer(o.bytes);
  float* dst = AllocBuffer(o.bytes);
  int max_threads = *std::max_element(o.threads.begin(), o.threads.end());
  // Touch every page (from the threads that will use them) before timing.
  Parallel(max_threads, o.bytes, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin / 4; i < end / 4; ++i) src[i] = 1.0f;
    std::memset(reinterpret_cast<char*>(dst) + begin, 0, static_cast<size_t>(end - begin));
  });

  for (int threads : o.threads) {
    double copy = Best(o.seconds / 2, 2 * o.bytes, [&] {
      return Parallel(threads, o.bytes, [&](int, int64_t begin, int64_t end) {
        std::memcpy(reinterpret_cast<char*>(dst) + begin,
                    reinterpret_cast<const char*>(src) + begin, static_cast<size_t>(end - begin));
      });
    });
    double read = Best(o.seconds / 2, o.bytes, [&] {
      std::vector<float> partial(static_cast<size_t>(threads));
      double t = Parallel(threads, o.bytes, [&](int thread, int64_t begin, int64_t end) {
        partial[static_cast<size_t>(thread)] = SumFloats(src + begin / 4, (end - begin) / 4);
      });
      for (float p : partial) g_sink = g_sink + p;
      return t;
    });
    for (auto [name, gbps] : {std::pair<const char*, double>{"copy", copy}, {"read", read}}) {
      std::printf(
          "{\"impl\":\"membw\",\"case\":\"%s\",\"threads\":%d,\"bytes\":%lld,"
          "\"GBps\":%.2f}\n",
          name, threads, static_cast<long long>(o.bytes), gbps);
    }
    std::fflush(stdout);
  }
  std::free(src);
  std::free(dst);
  return 0;
}
