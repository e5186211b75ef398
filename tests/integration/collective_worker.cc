// A trainer process for the collective integration tests: registers with a real gradsyncd,
// runs one scenario against shared-memory buffers, and checks every value against what this
// file computes on its own (no daemon code is used to compute expectations).
//
//   collective_worker <target> <job> <world_size> <rank> <scenario> [key=value...]
//
// Exit 0: every check passed. 1: a check failed (details on stderr). 2: setup failed.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/gradsync_client.h"

namespace gradsync {
namespace {

using client::Client;
using client::Op;
using client::OpOptions;
using client::Segment;
using client::SharedBuffer;

int failures = 0;

#define EXPECT_TRUE_OR_REPORT(cond, ...)                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++failures;                                                          \
      std::fprintf(stderr, "rank %d CHECK FAILED %s: %s\n", g_rank, #cond, \
                   absl::StrCat(__VA_ARGS__).c_str());                     \
    }                                                                      \
  } while (0)

int g_rank = 0;
int g_world = 1;
std::map<std::string, std::string> g_args;

std::string Arg(const std::string& key, const std::string& fallback) {
  auto it = g_args.find(key);
  return it == g_args.end() ? fallback : it->second;
}

// --- Element codecs: exact small values only, independent of the daemon's kernels. ---
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
// The compiler's binary16: _Float16, or with clang before 15 (no _Float16 on x86-64) __fp16,
// which converts the same way but may not be a parameter or a return type.
#if defined(__clang__) && __clang_major__ < 15
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif

template <typename T>
struct Codec {
  static T Encode(double v) { return static_cast<T>(v); }
  static double Decode(T v) { return static_cast<double>(v); }
};
template <>
struct Codec<F16> {
  static F16 Encode(double v) {
    const CompilerHalf h = static_cast<CompilerHalf>(static_cast<float>(v));
    F16 out;
    std::memcpy(&out.bits, &h, 2);
    return out;
  }
  static double Decode(F16 v) {
    CompilerHalf h;
    std::memcpy(&h, &v.bits, 2);
    return static_cast<double>(static_cast<float>(h));
  }
};
template <>
struct Codec<BF16> {
  // Exact for the values used here (at most 8 significant bits): truncation loses nothing.
  static BF16 Encode(double v) {
    const float f = static_cast<float>(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return BF16{static_cast<uint16_t>(u >> 16)};
  }
  static double Decode(BF16 v) {
    const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// Rank r's input element i: small integers, exact in every dtype, signs mixed.
double Value(int r, int64_t i) {
  const double magnitude = static_cast<double>((r + 1) * ((i % 7) + 1));
  return i % 3 == 0 ? -magnitude : magnitude;
}

bool IsInteger(DType d) { return d == v1::INT32 || d == v1::INT64; }

// The reduction of Value(r, i) over `ranks`, as the op defines it.
double Expected(v1::ReduceOp op, DType dtype, const std::vector<int>& ranks, int64_t i) {
  double acc = Value(ranks[0], i);
  for (size_t k = 1; k < ranks.size(); ++k) {
    const double v = Value(ranks[k], i);
    if (op == v1::SUM || op == v1::MEAN) acc += v;
    if (op == v1::MIN) acc = std::min(acc, v);
    if (op == v1::MAX) acc = std::max(acc, v);
  }
  if (op == v1::MEAN) {
    const double n = static_cast<double>(ranks.size());
    acc = IsInteger(dtype) ? std::trunc(acc / n) : acc / n;
  }
  return acc;
}

template <typename T>
void FillT(std::byte* base, int64_t count, int r, int64_t first_index) {
  T* p = reinterpret_cast<T*>(base);
  for (int64_t i = 0; i < count; ++i) p[i] = Codec<T>::Encode(Value(r, first_index + i));
}

template <typename T>
int64_t CheckT(const std::byte* base, int64_t count, const std::function<double(int64_t)>& want,
               std::string* first_bad) {
  const T* p = reinterpret_cast<const T*>(base);
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double got = Codec<T>::Decode(p[i]);
    const double w = want(i);
    if (got != w) {
      if (bad == 0) *first_bad = absl::StrCat("element ", i, ": got ", got, " want ", w);
      ++bad;
    }
  }
  return bad;
}

#define DISPATCH(dtype, F, ...)       \
  switch (dtype) {                    \
    case v1::FLOAT32:                 \
      return F<float>(__VA_ARGS__);   \
    case v1::FLOAT64:                 \
      return F<double>(__VA_ARGS__);  \
    case v1::FLOAT16:                 \
      return F<F16>(__VA_ARGS__);     \
    case v1::BFLOAT16:                \
      return F<BF16>(__VA_ARGS__);    \
    case v1::INT32:                   \
      return F<int32_t>(__VA_ARGS__); \
    case v1::INT64:                   \
      return F<int64_t>(__VA_ARGS__); \
    default:                          \
      std::abort();                   \
  }

void Fill(DType d, std::byte* base, int64_t count, int r, int64_t first = 0) {
  DISPATCH(d, FillT, base, count, r, first);
}
int64_t Check(DType d, const std::byte* base, int64_t count,
              const std::function<double(int64_t)>& want, std::string* first_bad) {
  DISPATCH(d, CheckT, base, count, want, first_bad);
}

const std::vector<DType> kDTypes = {v1::FLOAT32,  v1::FLOAT64, v1::FLOAT16,
                                    v1::BFLOAT16, v1::INT32,   v1::INT64};

OpOptions Opt(std::string group, std::string name = "",
              absl::Duration timeout = absl::ZeroDuration()) {
  OpOptions o;
  o.group = std::move(group);
  o.name = std::move(name);
  o.timeout = timeout;
  return o;
}

std::vector<int> World() {
  std::vector<int> all;
  for (int r = 0; r < g_world; ++r) all.push_back(r);
  return all;
}

std::vector<int64_t> ParseSizes(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

// Every op x dtype x element count, WORLD group; input and output areas of one buffer.
void Matrix(Client& c) {
  // counts=...: element counts for every dtype. bytes=B instead: B bytes per dtype (the larger
  // side of all-gather and reduce-scatter is B too).
  const int64_t bytes = std::stoll(Arg("bytes", "0"));
  const std::vector<int64_t> counts = ParseSizes(Arg("counts", "0,1,7,1023,65537"));
  int64_t max_count = 0;
  for (int64_t n : counts) max_count = std::max(max_count, n);
  const int64_t area = bytes > 0 ? bytes : max_count * 8 * g_world;
  auto buffer = c.CreateBuffer(2 * area + 64);
  if (!buffer.ok()) {
    std::fprintf(stderr, "CreateBuffer: %s\n", buffer.status().ToString().c_str());
    std::exit(2);
  }
  SharedBuffer& b = **buffer;
  std::byte* in = b.data();
  std::byte* out = b.data() + area;
  const std::vector<int> world = World();
  const int root = g_world - 1;
  int cases = 0;
  std::vector<DType> dtypes;
  for (DType d : kDTypes) {
    const std::string only = Arg("dtypes", "");
    if (only.empty() ||
        absl::StrContains(absl::StrCat(",", only, ","), absl::StrCat(",", DTypeName(d), ","))) {
      dtypes.push_back(d);
    }
  }
  for (DType d : dtypes) {
    const int64_t es = DTypeSize(d);
    for (int64_t n : bytes > 0 ? std::vector<int64_t>{bytes / es} : counts) {
      const int64_t ng = bytes > 0 ? n / g_world : n;  // all-gather / reduce-scatter block
      std::string bad;
      const std::string where = absl::StrCat(" dtype=", DTypeName(d), " count=", n);
      const bool reduce_only = Arg("ops", "all") == "reduce";  // all_reduce, broadcast, barrier
      for (v1::ReduceOp op : {v1::SUM, v1::MEAN, v1::MIN, v1::MAX}) {
        Fill(d, in, n, g_rank);
        absl::Status s = c.AllReduce(d, op, {{b.id(), 0, n}});
        EXPECT_TRUE_OR_REPORT(s.ok(), "all_reduce", where, " ", s.ToString());
        const int64_t wrong = Check(
            d, in, n, [&](int64_t i) { return Expected(op, d, world, i); }, &bad);
        EXPECT_TRUE_OR_REPORT(wrong == 0, "all_reduce op=", op, where, " wrong=", wrong, " ", bad);
        ++cases;
      }
      // Broadcast from the last rank.
      Fill(d, in, n, g_rank);
      absl::Status s = c.Broadcast(d, root, {{b.id(), 0, n}});
      EXPECT_TRUE_OR_REPORT(s.ok(), "broadcast", where, " ", s.ToString());
      int64_t wrong = Check(
          d, in, n, [&](int64_t i) { return Value(root, i); }, &bad);
      EXPECT_TRUE_OR_REPORT(wrong == 0, "broadcast", where, " wrong=", wrong, " ", bad);
      if (reduce_only) {
        cases += 1;
        continue;
      }
      // All-gather: block q of the output is rank q's input.
      const int64_t block = std::max<int64_t>(ng, 1);
      Fill(d, in, ng, g_rank);
      s = c.AllGatherAsync(d, {{b.id(), 0, ng}}, {{b.id(), area, ng * g_world}}).Wait();
      EXPECT_TRUE_OR_REPORT(s.ok(), "all_gather", where, " ", s.ToString());
      wrong = Check(
          d, out, ng * g_world, [&](int64_t j) { return Value(j / block, j % block); }, &bad);
      EXPECT_TRUE_OR_REPORT(wrong == 0, "all_gather", where, " wrong=", wrong, " ", bad);
      // Reduce-scatter (sum and mean): my output is the reduction of block `rank`.
      for (v1::ReduceOp op : {v1::SUM, v1::MEAN}) {
        Fill(d, in, ng * g_world, g_rank);
        s = c.ReduceScatterAsync(d, op, {{b.id(), 0, ng * g_world}}, {{b.id(), area, ng}}).Wait();
        EXPECT_TRUE_OR_REPORT(s.ok(), "reduce_scatter", where, " ", s.ToString());
        wrong = Check(
            d, out, ng, [&](int64_t i) { return Expected(op, d, world, g_rank * ng + i); }, &bad);
        EXPECT_TRUE_OR_REPORT(wrong == 0, "reduce_scatter op=", op, where, " wrong=", wrong, " ",
                              bad);
      }
      cases += 4;
      (void)es;
    }
  }
  absl::Status s = c.Barrier();
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier ", s.ToString());
  std::printf("matrix cases=%d\n", cases);
}

std::unique_ptr<SharedBuffer> MustBuffer(Client& c, int64_t bytes,
                                         DType dtype = v1::DTYPE_UNSPECIFIED) {
  auto buffer = c.CreateBuffer(bytes, dtype);
  if (!buffer.ok()) {
    std::fprintf(stderr, "CreateBuffer: %s\n", buffer.status().ToString().c_str());
    std::exit(2);
  }
  return *std::move(buffer);
}

// 128 all-reduces in flight at once on distinct slices, then waited for in reverse order.
void Async(Client& c) {
  constexpr int kOps = 128;
  constexpr int64_t kCount = 1000;
  auto b = MustBuffer(c, kOps * kCount * 4, v1::FLOAT32);
  float* p = reinterpret_cast<float*>(b->data());
  for (int k = 0; k < kOps; ++k) {
    for (int64_t i = 0; i < kCount; ++i)
      p[k * kCount + i] = static_cast<float>(Value(g_rank, k + i));
  }
  std::vector<Op> ops;
  for (int k = 0; k < kOps; ++k) {
    ops.push_back(c.AllReduceAsync(v1::FLOAT32, v1::SUM, {{b->id(), k * kCount * 4, kCount}},
                                   Opt("world", absl::StrCat("grad", k))));
  }
  int done = 0;
  for (int k = kOps - 1; k >= 0; --k) {
    absl::Status s = ops[k].Wait();
    EXPECT_TRUE_OR_REPORT(s.ok(), "op ", k, " ", s.ToString());
    EXPECT_TRUE_OR_REPORT(ops[k].seq() == static_cast<uint64_t>(k), "op ", k, " seq ",
                          ops[k].seq());
    done += s.ok();
  }
  const std::vector<int> world = World();
  for (int k = 0; k < kOps; ++k) {
    for (int64_t i = 0; i < kCount; ++i) {
      const double want = Expected(v1::SUM, v1::FLOAT32, world, k + i);
      if (p[k * kCount + i] != want) {
        EXPECT_TRUE_OR_REPORT(false, "op ", k, " element ", i, " got ", p[k * kCount + i], " want ",
                              want);
        break;
      }
    }
  }
  std::printf("async done=%d\n", done);
}

// Ops queued on the world group all at once, so that a daemon hands runs of them to its
// communicator together: small all-reduces (each its own slice), a chain of three all-reduces
// of one slice (each reads the one before), one over 256 KiB (Gloo's ring, amid small ones), a
// broadcast, an all-gather, a reduce-scatter, a barrier, and one op that the ranks of the last
// node (local_world_size ranks at the top) name differently: it alone fails, naming both
// fingerprints, and leaves its slice as it was; every other op's values are checked.
void Queued(Client& c) {
  constexpr int kSmall = 60;
  // count=N: elements of each small op (N=10000: the run spans several stream messages).
  const int64_t small_count = std::stoll(Arg("count", "1000"));
  constexpr int64_t kChain = 500, kLarge = 100000, kOdd = 100, kPart = 250;
  const int local_world = std::stoi(Arg("local_world_size", std::to_string(g_world)));
  const bool last_node = g_rank >= g_world - local_world;
  const int64_t small_at = 0, chain_at = small_at + kSmall * small_count,
                large_at = chain_at + kChain, odd_at = large_at + kLarge, bcast_at = odd_at + kOdd,
                gin_at = bcast_at + small_count, gout_at = gin_at + kPart,
                rsin_at = gout_at + kPart * g_world, rsout_at = rsin_at + kPart * g_world,
                end = rsout_at + kPart;
  auto b = MustBuffer(c, end * 4, v1::FLOAT32);
  float* p = reinterpret_cast<float*>(b->data());
  for (int64_t i = 0; i < end; ++i) p[i] = static_cast<float>(Value(g_rank, i));
  auto seg = [&](int64_t at, int64_t n) { return std::vector<Segment>{{b->id(), at * 4, n}}; };
  std::vector<Op> ops;
  std::vector<std::string> what;
  auto add = [&](Op op, std::string name) {
    ops.push_back(std::move(op));
    what.push_back(std::move(name));
  };
  int odd_index = -1;
  for (int k = 0; k < kSmall; ++k) {
    add(c.AllReduceAsync(v1::FLOAT32, v1::SUM, seg(small_at + k * small_count, small_count)),
        absl::StrCat("small ", k));
    if (k == 10) {
      for (int j = 0; j < 3; ++j) {
        add(c.AllReduceAsync(v1::FLOAT32, v1::SUM, seg(chain_at, kChain)), "chain");
      }
    }
    if (k == 20) add(c.AllReduceAsync(v1::FLOAT32, v1::MAX, seg(large_at, kLarge)), "large");
    if (k == 30) {
      odd_index = static_cast<int>(ops.size());
      add(c.AllReduceAsync(v1::FLOAT32, v1::SUM, seg(odd_at, kOdd),
                           Opt("world", last_node ? "odd-there" : "odd-here")),
          "odd");
    }
    if (k == 40) {
      add(c.BroadcastAsync(v1::FLOAT32, g_world - 1, seg(bcast_at, small_count)), "broadcast");
      add(c.AllGatherAsync(v1::FLOAT32, seg(gin_at, kPart), seg(gout_at, kPart * g_world)),
          "all-gather");
      add(c.ReduceScatterAsync(v1::FLOAT32, v1::MIN, seg(rsin_at, kPart * g_world),
                               seg(rsout_at, kPart)),
          "reduce-scatter");
      add(c.BarrierAsync(), "barrier");
    }
  }
  int ok = 0;
  for (size_t k = 0; k < ops.size(); ++k) {
    const absl::Status s = ops[k].Wait();
    if (static_cast<int>(k) == odd_index) {
      EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kFailedPrecondition, s.ToString());
      EXPECT_TRUE_OR_REPORT(
          absl::StrContains(s.message(), "odd-here") && absl::StrContains(s.message(), "odd-there"),
          s.ToString());
    } else {
      EXPECT_TRUE_OR_REPORT(s.ok(), what[k], " ", s.ToString());
      ok += s.ok();
    }
  }
  const std::vector<int> world = World();
  std::string bad;
  auto check = [&](const char* name, int64_t at, int64_t n,
                   const std::function<double(int64_t)>& want) {
    EXPECT_TRUE_OR_REPORT(Check(v1::FLOAT32, b->data() + at * 4, n, want, &bad) == 0, name, " ",
                          bad);
  };
  check("small", small_at, kSmall * small_count,
        [&](int64_t i) { return Expected(v1::SUM, v1::FLOAT32, world, small_at + i); });
  check("chain", chain_at, kChain, [&](int64_t i) {
    return g_world * g_world * Expected(v1::SUM, v1::FLOAT32, world, chain_at + i);
  });
  check("large", large_at, kLarge,
        [&](int64_t i) { return Expected(v1::MAX, v1::FLOAT32, world, large_at + i); });
  check("odd (failed: unchanged)", odd_at, kOdd,
        [&](int64_t i) { return Value(g_rank, odd_at + i); });
  check("broadcast", bcast_at, small_count,
        [&](int64_t i) { return Value(g_world - 1, bcast_at + i); });
  check("all-gather", gout_at, kPart * g_world,
        [&](int64_t i) { return Value(static_cast<int>(i / kPart), gin_at + i % kPart); });
  check("reduce-scatter", rsout_at, kPart, [&](int64_t i) {
    return Expected(v1::MIN, v1::FLOAT32, world, rsin_at + g_rank * kPart + i);
  });
  std::printf("queued ok=%d of %zu\n", ok, ops.size());
}

// One fused all-reduce over a pack of 37 gradients of assorted odd sizes, laid out in a
// different order in each rank's buffer (so segment boundaries differ between ranks).
void Fused(Client& c) {
  constexpr int kGrads = 37;
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (int g = 0; g < kGrads; ++g) {
    sizes.push_back(1 + (g * 7919) % 3001);
    total += sizes.back();
  }
  auto b = MustBuffer(c, total * 2, v1::BFLOAT16);
  // Physical placement: rank-dependent rotation of the gradients.
  std::vector<int64_t> offset(kGrads);
  int64_t at = 0;
  for (int k = 0; k < kGrads; ++k) {
    const int g = (k + g_rank * 5) % kGrads;
    offset[g] = at;
    at += sizes[g];
  }
  std::vector<Segment> segments;
  int64_t logical = 0;
  for (int g = 0; g < kGrads; ++g) {
    Fill(v1::BFLOAT16, b->data() + offset[g] * 2, sizes[g], g_rank, logical);
    segments.push_back({b->id(), offset[g] * 2, sizes[g]});
    logical += sizes[g];
  }
  absl::Status s = c.AllReduce(v1::BFLOAT16, v1::MEAN, segments, Opt("world", "pack0"));
  EXPECT_TRUE_OR_REPORT(s.ok(), "fused ", s.ToString());
  const std::vector<int> world = World();
  logical = 0;
  int64_t wrong = 0;
  for (int g = 0; g < kGrads; ++g) {
    std::string bad;
    const int64_t base = logical;
    wrong += Check(
        v1::BFLOAT16, b->data() + offset[g] * 2, sizes[g],
        [&](int64_t i) { return Expected(v1::MEAN, v1::BFLOAT16, world, base + i); }, &bad);
    EXPECT_TRUE_OR_REPORT(wrong == 0, "gradient ", g, " ", bad);
    logical += sizes[g];
  }
  std::printf("fused elements=%lld wrong=%lld\n", static_cast<long long>(total),
              static_cast<long long>(wrong));
}

// Two disjoint pairs run their own all-reduces at the same time; then an odd group.
void Groups(Client& c) {
  constexpr int64_t kCount = 4099;
  auto b = MustBuffer(c, kCount * 8, v1::INT64);
  const std::vector<int> pair = g_rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
  const std::string key = g_rank < 2 ? "0,1" : "2,3";
  for (int round = 0; round < 5; ++round) {
    Fill(v1::INT64, b->data(), kCount, g_rank, round);
    absl::Status s = c.AllReduce(v1::INT64, v1::MEAN, {{b->id(), 0, kCount}}, Opt(key));
    EXPECT_TRUE_OR_REPORT(s.ok(), "group ", key, " ", s.ToString());
    std::string bad;
    const int64_t wrong = Check(
        v1::INT64, b->data(), kCount,
        [&](int64_t i) { return Expected(v1::MEAN, v1::INT64, pair, round + i); }, &bad);
    EXPECT_TRUE_OR_REPORT(wrong == 0, "group ", key, " round ", round, " ", bad);
  }
  // Group {0, 2, 3}: rank 1 sits it out; group rank of the broadcast root is 2 (global 3).
  if (g_rank != 1) {
    Fill(v1::INT64, b->data(), kCount, g_rank);
    absl::Status s = c.Broadcast(v1::INT64, 2, {{b->id(), 0, kCount}}, Opt("0,2,3"));
    EXPECT_TRUE_OR_REPORT(s.ok(), "group 0,2,3 ", s.ToString());
    std::string bad;
    const int64_t wrong = Check(
        v1::INT64, b->data(), kCount, [&](int64_t i) { return Value(3, i); }, &bad);
    EXPECT_TRUE_OR_REPORT(wrong == 0, "group 0,2,3 broadcast ", bad);
  }
  absl::Status s = c.Barrier();
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier ", s.ToString());
  std::printf("groups ok\n");
}

// The last rank submits a different count: every rank gets FAILED_PRECONDITION naming both
// fingerprints, buffers untouched; the next op works.
void Desync(Client& c) {
  auto b = MustBuffer(c, 64 * 4, v1::FLOAT32);
  Fill(v1::FLOAT32, b->data(), 64, g_rank);
  // across=1: every rank of the upper half (another daemon) submits the other count.
  const bool across = Arg("across", "0") == "1";
  const int64_t n = (across ? g_rank >= g_world / 2 : g_rank == g_world - 1) ? 17 : 16;
  absl::Status s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, n}}, Opt("world", "w"));
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kFailedPrecondition, s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), "desync"), s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), "count=16"), s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), "count=17"), s.ToString());
  if (!across) {
    EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), absl::StrCat("rank ", g_world - 1)),
                          s.ToString());
  }
  std::string bad;
  EXPECT_TRUE_OR_REPORT(
      Check(
          v1::FLOAT32, b->data(), 64, [](int64_t i) { return Value(g_rank, i); }, &bad) == 0,
      "buffer changed by a failed op: ", bad);
  s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 16}});
  EXPECT_TRUE_OR_REPORT(s.ok(), "op after desync ", s.ToString());
  const std::vector<int> world = World();
  EXPECT_TRUE_OR_REPORT(
      Check(
          v1::FLOAT32, b->data(), 16,
          [&](int64_t i) { return Expected(v1::SUM, v1::FLOAT32, world, i); }, &bad) == 0,
      bad);
  std::printf("desync ok\n");
}

// The last rank never submits op 0 before it expires: the others get DEADLINE_EXCEEDED naming
// it; when it comes later it gets the same verdict; the group then works again.
void Deadline(Client& c) {
  auto b = MustBuffer(c, 16 * 4, v1::FLOAT32);
  const bool late = g_rank == g_world - 1;
  if (late) absl::SleepFor(absl::Milliseconds(1500));
  const absl::Time start = absl::Now();
  absl::Status s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 16}},
                               Opt("world", "slow", absl::Milliseconds(500)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kDeadlineExceeded, s.ToString());
  EXPECT_TRUE_OR_REPORT(
      absl::StrContains(s.message(), absl::StrCat("rank(s) ", g_world - 1, " never")),
      s.ToString());
  if (!late) EXPECT_TRUE_OR_REPORT(took < absl::Seconds(1.4), "took ", absl::FormatDuration(took));
  // Everybody meets at a barrier (the late rank is there now), then the group works.
  s = c.Barrier(Opt("world", "", absl::Seconds(20)));
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier after deadline ", s.ToString());
  Fill(v1::FLOAT32, b->data(), 16, g_rank);
  s = c.AllReduce(v1::FLOAT32, v1::MAX, {{b->id(), 0, 16}});
  EXPECT_TRUE_OR_REPORT(s.ok(), "op after deadline ", s.ToString());
  std::printf("deadline ok took_ms=%lld\n",
              static_cast<long long>(absl::ToInt64Milliseconds(took)));
}

// Kill test, the victim: meets the others at a barrier, then dies without a word.
void Victim(Client& c) {
  auto b = MustBuffer(c, 1 << 20, v1::FLOAT32);  // a mapping the daemon must release
  absl::Status s = c.Barrier(Opt("world", "", absl::Seconds(30)));
  if (!s.ok()) std::exit(2);
  absl::SleepFor(absl::Milliseconds(300));
  ::raise(SIGKILL);
}

// Kill test, the survivors: block in an all-reduce the victim never joins; it must fail
// UNAVAILABLE naming the dead rank well within the op's deadline.
void Survivor(Client& c) {
  auto b = MustBuffer(c, 1024 * 4, v1::FLOAT32);
  absl::Status s = c.Barrier(Opt("world", "", absl::Seconds(30)));
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier ", s.ToString());
  const absl::Time start = absl::Now();
  s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 1024}}, Opt("world", "", absl::Seconds(60)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE_OR_REPORT(
      s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kAborted,
      s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), absl::StrCat("rank ", g_world - 1, " left")),
                        s.ToString());
  EXPECT_TRUE_OR_REPORT(took < absl::Seconds(10), "took ", absl::FormatDuration(took));
  // Later ops on a group with the dead rank fail at once; a group without it still works.
  s = c.Barrier();
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kUnavailable, "barrier ", s.ToString());
  if (g_world > 2) {
    std::string key;
    for (int r = 0; r < g_world - 1; ++r) absl::StrAppend(&key, r == 0 ? "" : ",", r);
    s = c.Barrier(Opt(key));
    EXPECT_TRUE_OR_REPORT(s.ok(), "barrier of the living ", s.ToString());
  }
  std::printf("survivor ok took_ms=%lld\n",
              static_cast<long long>(absl::ToInt64Milliseconds(took)));
}

// Jobs spanning daemons: the last rank, alone on its daemon, comes after the op's deadline.
// The op fails on every node (DEADLINE_EXCEEDED naming the late node's ranks), with one verdict
// everywhere, so the group goes on.
void DeadlineAcross(Client& c) {
  auto b = MustBuffer(c, 16 * 4, v1::FLOAT32);
  const bool late = g_rank == g_world - 1;
  if (late) absl::SleepFor(absl::Milliseconds(1500));
  absl::Status s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 16}},
                               Opt("world", "slow", absl::Milliseconds(500)));
  EXPECT_TRUE_OR_REPORT(!s.ok(), "late op succeeded");
  if (!late) {
    EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kDeadlineExceeded, s.ToString());
    EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), absl::StrCat("ranks ", g_world - 1, ")")),
                          s.ToString());
  }
  // Every node gave the same verdict for the op, so the group goes on.
  s = c.Barrier(Opt("world", "", absl::Seconds(20)));
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier after deadline ", s.ToString());
  std::printf("deadline across ok\n");
}

// Jobs spanning daemons whose other ranks never come: the op fails once the formation deadline
// (the daemon's --op_timeout) passes, naming the ranks nobody published.
void NoForm(Client& c) {
  absl::Status s = c.Barrier();
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kDeadlineExceeded, s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), "did not form"), s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), absl::StrCat("daemon/rank/", g_world - 1)),
                        s.ToString());
  std::printf("noform ok\n");
}

// Jobs spanning daemons whose store cannot be reached (--store=etcd with etcd down): the first
// op fails UNAVAILABLE naming the store (needle=TEXT) once the daemon's store call gives up,
// long before the op's own 60 s deadline.
void StoreDown(Client& c) {
  const absl::Time start = absl::Now();
  absl::Status s = c.Barrier(Opt("world", "", absl::Seconds(60)));
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kUnavailable, s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), Arg("needle", "etcd")), s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::Now() - start < absl::Seconds(30), "took ",
                        absl::FormatDuration(absl::Now() - start));
  std::printf("storedown ok\n");
}

// Waits at a barrier with everyone, then idles (bounded) while the test kills its daemon.
void Idle(Client& c) {
  absl::Status s = c.Barrier(Opt("world", "", absl::Seconds(30)));
  if (!s.ok()) std::exit(2);
  std::printf("idle ok\n");
  std::fflush(stdout);
  // A group of this rank alone completes at once while the daemon lives (bounded: 20 s).
  for (int i = 0; i < 200 && c.Barrier(Opt(std::to_string(g_rank))).ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// Observability: `ops=N` small all-reduces named "step"; rank `freeze` stops itself (SIGSTOP)
// before op `freeze_at` and goes on when the test sends SIGCONT. Every sum is checked.
void Steps(Client& c) {
  const int ops = std::stoi(Arg("ops", "20"));
  const int freeze = std::stoi(Arg("freeze", "-1"));
  const int freeze_at = std::stoi(Arg("freeze_at", "10"));
  auto b = MustBuffer(c, 16 * 4, v1::FLOAT32);
  float* v = reinterpret_cast<float*>(b->data());
  int wrong = 0;
  for (int k = 0; k < ops; ++k) {
    if (g_rank == freeze && k == freeze_at) {
      std::printf("freezing before op %d\n", k);
      std::fflush(stdout);
      ::raise(SIGSTOP);
    }
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(g_rank + k);
    absl::Status s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 16}},
                                 Opt("world", "step", absl::Seconds(120)));
    EXPECT_TRUE_OR_REPORT(s.ok(), "step ", k, " ", s.ToString());
    const float want = static_cast<float>(g_world * k + g_world * (g_world - 1) / 2);
    for (int i = 0; i < 16; ++i) wrong += v[i] != want;
  }
  EXPECT_TRUE_OR_REPORT(wrong == 0, "steps wrong=", wrong);
  std::printf("steps ok ops=%d wrong=%d\n", ops, wrong);
  std::fflush(stdout);
  // hold=PATH: stay attached (the job, and its history, live on) until PATH exists (<= 60 s).
  const std::string hold = Arg("hold", "");
  for (int i = 0; !hold.empty() && i < 600 && ::access(hold.c_str(), F_OK) != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// Another node's daemon dies while this rank's op waits on it: UNAVAILABLE well before the
// op's deadline, naming the op; this node's daemon stays up.
void NodeSurvivor(Client& c) {
  auto b = MustBuffer(c, 1 << 20, v1::FLOAT32);
  absl::Status s = c.Barrier(Opt("world", "", absl::Seconds(30)));
  EXPECT_TRUE_OR_REPORT(s.ok(), "barrier ", s.ToString());
  const absl::Time start = absl::Now();
  s = c.AllReduce(v1::FLOAT32, v1::SUM, {{b->id(), 0, 1 << 18}},
                  Opt("world", "", absl::Seconds(60)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kUnavailable, s.ToString());
  EXPECT_TRUE_OR_REPORT(absl::StrContains(s.message(), "all_reduce job="), s.ToString());
  EXPECT_TRUE_OR_REPORT(took < absl::Seconds(20), "took ", absl::FormatDuration(took));
  std::printf("node survivor ok took_ms=%lld error=%s\n",
              static_cast<long long>(absl::ToInt64Milliseconds(took)),
              std::string(s.message()).c_str());
}

// Every kind of bad input gets its specific code and changes nothing: afterwards the buffer
// is as it was and the first valid op is still op 0 of the group.
void BadInput(Client& c, const std::string& target, const client::Placement& me) {
  const std::string& job = me.job;
  auto b = MustBuffer(c, 256, v1::FLOAT32);
  Fill(v1::FLOAT32, b->data(), 64, g_rank);
  const uint64_t id = b->id();
  struct Case {
    std::string what;
    v1::OpRequest op;
    absl::StatusCode code;
    std::string needle;
  };
  auto ar = [&](std::vector<v1::Segment> in) {
    v1::OpRequest op;
    op.set_kind(v1::ALL_REDUCE);
    op.set_reduce_op(v1::SUM);
    op.set_dtype(v1::FLOAT32);
    op.set_group("world");
    for (auto& s : in) *op.add_input() = s;
    return op;
  };
  auto seg = [](uint64_t buffer, int64_t offset, int64_t count) {
    v1::Segment s;
    s.set_buffer_id(buffer);
    s.set_byte_offset(offset);
    s.set_count(count);
    return s;
  };
  std::vector<Case> cases;
  cases.push_back(
      {"unknown buffer", ar({seg(999, 0, 4)}), absl::StatusCode::kNotFound, "buffer 999"});
  cases.push_back(
      {"offset past end", ar({seg(id, 256, 1)}), absl::StatusCode::kInvalidArgument, "outside"});
  cases.push_back(
      {"misaligned", ar({seg(id, 2, 4)}), absl::StatusCode::kInvalidArgument, "aligned"});
  cases.push_back(
      {"count past end", ar({seg(id, 0, 65)}), absl::StatusCode::kInvalidArgument, "outside"});
  cases.push_back(
      {"negative count", ar({seg(id, 0, -1)}), absl::StatusCode::kInvalidArgument, "outside"});
  cases.push_back({"overlap", ar({seg(id, 0, 10), seg(id, 20, 10)}),
                   absl::StatusCode::kInvalidArgument, "overlap"});
  {
    v1::OpRequest op = ar({seg(id, 0, 4)});
    op.set_dtype(v1::FLOAT64);
    cases.push_back(
        {"dtype mismatch", op, absl::StatusCode::kInvalidArgument, "registered as float32"});
    op = ar({seg(id, 0, 4)});
    op.set_group("0,5");
    cases.push_back({"rank out of range", op, absl::StatusCode::kInvalidArgument, "world_size"});
    op.set_group(g_rank == 0 ? "1" : "0");
    cases.push_back({"not a member", op, absl::StatusCode::kInvalidArgument, "not a member"});
    op.set_group("1,0");
    cases.push_back({"unsorted group", op, absl::StatusCode::kInvalidArgument, "group"});
    op = ar({seg(id, 0, 4)});
    op.set_reduce_op(v1::REDUCE_OP_UNSPECIFIED);
    cases.push_back({"no reduce op", op, absl::StatusCode::kInvalidArgument, "reduce_op"});
    op = ar({seg(id, 0, 4)});
    op.set_kind(static_cast<v1::OpKind>(42));
    cases.push_back({"unknown kind", op, absl::StatusCode::kInvalidArgument, "kind"});
    op = ar({seg(id, 0, 4)});
    op.set_dtype(static_cast<v1::DType>(99));
    cases.push_back({"unknown dtype", op, absl::StatusCode::kInvalidArgument, "dtype"});
    op = ar({seg(id, 0, 4)});
    op.set_timeout_ms(-5);
    cases.push_back({"negative timeout", op, absl::StatusCode::kInvalidArgument, "timeout"});
    op = ar({seg(id, 0, 4)});
    *op.add_output() = seg(id, 64, 4);
    cases.push_back({"all_reduce with output", op, absl::StatusCode::kInvalidArgument, "in place"});
    op = ar({seg(id, 0, 4)});
    op.set_kind(v1::BROADCAST);
    op.set_root(7);
    cases.push_back({"bad root", op, absl::StatusCode::kInvalidArgument, "root"});
    op = ar({seg(id, 0, 4)});
    op.set_kind(v1::ALL_GATHER);
    *op.add_output() = seg(id, 64, 5);
    cases.push_back({"all_gather size", op, absl::StatusCode::kInvalidArgument, "group size"});
  }
  for (const Case& k : cases) {
    absl::Status s = c.Submit(k.op).Wait();
    EXPECT_TRUE_OR_REPORT(s.code() == k.code && absl::StrContains(s.message(), k.needle), k.what,
                          ": got ", s.ToString());
  }

  // Buffer registration errors. Memory is never named: a name is refused.
  v1::RegisterBufferRequest reg;
  reg.set_shm_name("/gradsync-test-does-not-exist");
  reg.set_bytes(64);
  auto r = c.RegisterBuffer(reg);
  EXPECT_TRUE_OR_REPORT(r.status().code() == absl::StatusCode::kInvalidArgument &&
                            absl::StrContains(r.status().message(), "never registered by name"),
                        "by name: ", r.status().ToString());
  reg.clear_shm_name();
  reg.set_fd_token("0123456789abcdef0123456789abcdef");
  r = c.RegisterBuffer(reg);
  EXPECT_TRUE_OR_REPORT(r.status().code() == absl::StatusCode::kNotFound,
                        "unknown token: ", r.status().ToString());
  auto memfd = [](int64_t bytes, unsigned seals) {
    const int fd = ::memfd_create("gradsync-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, bytes) != 0 || (seals && ::fcntl(fd, F_ADD_SEALS, seals) != 0)) {
      std::exit(2);
    }
    return fd;
  };
  auto shared = [&](int fd, int64_t bytes) {
    auto token = c.ShareFd(fd);
    if (!token.ok()) std::exit(2);
    v1::RegisterBufferRequest req;
    req.set_fd_token(*token);
    req.set_bytes(bytes);
    return req;
  };
  int fd = memfd(100, 0);  // could shrink under the daemon's mapping (SIGBUS): refused
  r = c.RegisterBuffer(shared(fd, 100));
  EXPECT_TRUE_OR_REPORT(r.status().code() == absl::StatusCode::kInvalidArgument &&
                            absl::StrContains(r.status().message(), "not sealed"),
                        "unsealed: ", r.status().ToString());
  ::close(fd);
  fd = memfd(100, F_SEAL_SHRINK);
  r = c.RegisterBuffer(shared(fd, 200));
  EXPECT_TRUE_OR_REPORT(r.status().code() == absl::StatusCode::kFailedPrecondition,
                        "too small: ", r.status().ToString());
  reg = shared(fd, 100);
  r = c.RegisterBuffer(reg);
  EXPECT_TRUE_OR_REPORT(r.ok(), "fits: ", r.status().ToString());
  EXPECT_TRUE_OR_REPORT(::ftruncate(fd, 0) != 0 && errno == EPERM, "sealed: shrink refused");
  auto again = c.RegisterBuffer(reg);  // this session holds that buffer already
  EXPECT_TRUE_OR_REPORT(again.status().code() == absl::StatusCode::kAlreadyExists,
                        "duplicate: ", again.status().ToString());
  ::close(fd);
  if (r.ok()) EXPECT_TRUE_OR_REPORT(c.DeregisterBuffer(*r).ok(), "deregister");
  absl::Status s = c.DeregisterBuffer(12345);
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kNotFound,
                        "deregister unknown: ", s.ToString());

  // A CUDA buffer: without a usable GPU (this daemon's machine) FAILED_PRECONDITION with CUDA's
  // reason; with one, a made-up handle is INVALID_ARGUMENT. Either way nothing is registered.
  {
    v1::RegisterBufferRequest cuda;
    cuda.set_bytes(64);
    v1::CudaIpcBuffer* h = cuda.mutable_cuda();
    h->set_mem_handle(std::string(64, 'x'));
    h->set_ready_event(std::string(64, 'r'));
    h->set_done_event(std::string(64, 'd'));
    h->set_pid(::getpid());
    auto rc = c.RegisterBuffer(cuda);
    const bool gpu = ::access("/dev/nvidia0", F_OK) == 0;
    EXPECT_TRUE_OR_REPORT(
        gpu ? rc.status().code() == absl::StatusCode::kInvalidArgument
            : rc.status().code() == absl::StatusCode::kFailedPrecondition &&
                  absl::StrContains(rc.status().message(), "cannot map CUDA buffers"),
        "cuda buffer: ", rc.status().ToString());
  }

  // Registration errors (a second session each; this one stays healthy).
  const int local_world = me.local_world_size;
  const bool one_node = local_world == g_world;
  auto try_register = [&](int world, int rank, int local_world, std::string root) {
    client::Placement p{job, world, rank, rank % local_world, local_world, std::move(root)};
    return Client::Connect(target, p).status();
  };
  s = try_register(g_world, g_rank, local_world, me.root_address);
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kAlreadyExists,
                        "same rank twice: ", s.ToString());
  s = try_register(g_world, g_world + 3, local_world, me.root_address);
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kInvalidArgument,
                        "rank out of range: ", s.ToString());
  s = try_register(g_world + 1, g_rank, one_node ? g_world + 1 : local_world, me.root_address);
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kInvalidArgument,
                        "world mismatch: ", s.ToString());
  s = try_register(g_world * 2, g_rank, local_world, "");
  EXPECT_TRUE_OR_REPORT(s.code() == absl::StatusCode::kFailedPrecondition,
                        "spans nodes: ", s.ToString());

  // Nothing changed: the buffer is intact and the next valid op is op 0.
  std::string bad;
  EXPECT_TRUE_OR_REPORT(
      Check(
          v1::FLOAT32, b->data(), 64, [](int64_t i) { return Value(g_rank, i); }, &bad) == 0,
      "buffer changed: ", bad);
  Op op = c.AllReduceAsync(v1::FLOAT32, v1::SUM, {{id, 0, 64}});
  s = op.Wait();
  EXPECT_TRUE_OR_REPORT(s.ok() && op.seq() == 0, "valid op after bad ones: ", s.ToString(), " seq ",
                        op.seq());
  const std::vector<int> world = World();
  EXPECT_TRUE_OR_REPORT(
      Check(
          v1::FLOAT32, b->data(), 64,
          [&](int64_t i) { return Expected(v1::SUM, v1::FLOAT32, world, i); }, &bad) == 0,
      bad);
  std::printf("badinput cases=%zu\n", cases.size() + 11);
}

}  // namespace
}  // namespace gradsync

int main(int argc, char** argv) {
  using namespace gradsync;
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s target job world_size rank scenario [key=value...]\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1], job = argv[2], scenario = argv[5];
  g_world = std::atoi(argv[3]);
  g_rank = std::atoi(argv[4]);
  for (int i = 6; i < argc; ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    g_args[kv.first] = kv.second;
  }
  // Jobs spanning daemons: local_world_size=L (ranks are placed in blocks of L) and root=ADDR.
  const int local_world = std::stoi(Arg("local_world_size", std::to_string(g_world)));
  client::Placement placement{job,         g_world,        g_rank, g_rank % local_world,
                              local_world, Arg("root", "")};
  client::ClientOptions options;
  options.doorbell = Arg("doorbell", "1") == "1";  // 0: ops over the gRPC stream
  auto c = client::Client::Connect(target, placement, options);
  if (!c.ok()) {
    std::fprintf(stderr, "rank %d connect: %s\n", g_rank, c.status().ToString().c_str());
    return 2;
  }
  if (scenario == "matrix")
    Matrix(**c);
  else if (scenario == "async")
    Async(**c);
  else if (scenario == "queued")
    Queued(**c);
  else if (scenario == "fused")
    Fused(**c);
  else if (scenario == "groups")
    Groups(**c);
  else if (scenario == "desync")
    Desync(**c);
  else if (scenario == "deadline")
    Deadline(**c);
  else if (scenario == "victim")
    Victim(**c);
  else if (scenario == "survivor")
    Survivor(**c);
  else if (scenario == "badinput")
    BadInput(**c, target, placement);
  else if (scenario == "deadlineacross")
    DeadlineAcross(**c);
  else if (scenario == "noform")
    NoForm(**c);
  else if (scenario == "storedown")
    StoreDown(**c);
  else if (scenario == "idle")
    Idle(**c);
  else if (scenario == "steps")
    Steps(**c);
  else if (scenario == "nodesurvivor")
    NodeSurvivor(**c);
  else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
