#include "daemon/backend/cpu/kernels.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace gradsync::backend::cpu {
namespace {

// The compiler's own binary16 conversions: _Float16, or with clang before 15 (no _Float16 on
// x86-64) __fp16, which converts the same way but may not be a parameter or a return type.
#if defined(__clang__) && __clang_major__ < 15
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif
uint16_t CompilerFloatToHalf(float f) {
  const CompilerHalf h = static_cast<CompilerHalf>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float CompilerHalfToFloat(uint16_t b) {
  CompilerHalf h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

TEST(HalfTest, EveryHalfConvertsToTheFloatTheCompilerGives) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float want = CompilerHalfToFloat(static_cast<uint16_t>(b));
    const float got = HalfToFloat(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      ASSERT_EQ(got, want) << "bits " << b;
    }
  }
}

TEST(HalfTest, FloatToHalfRoundsToNearestEvenLikeTheCompiler) {
  std::mt19937 rng(7);
  std::vector<float> samples = {0.0f,     -0.0f,   1.0f,     65504.0f, 65519.99f, 65520.0f,
                                1e9f,     -1e9f,   5.96e-8f, 2.98e-8f, 2.99e-8f,  6.1e-5f,
                                6.09e-5f, 2049.0f, 2051.0f,  INFINITY, -INFINITY};
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = any(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isnan(f)) samples.push_back(f);
  }
  for (float f : samples) {
    ASSERT_EQ(FloatToHalf(f), CompilerFloatToHalf(f)) << f;
  }
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(NAN))));
}

// Nearest bfloat16 by brute force on the two candidates, ties to even.
uint16_t ReferenceBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(static_cast<double>(BFloat16ToFloat(lo)) - f);
  const double dhi = std::fabs(static_cast<double>(BFloat16ToFloat(hi)) - f);
  if ((u & 0xffff) == 0) return lo;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

TEST(BFloat16Test, RoundsToNearestEven) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
  for (int i = 0; i < 200000; ++i) {
    const float f = dist(rng);
    ASSERT_EQ(FloatToBFloat16(f), ReferenceBf16(f)) << f;
  }
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.0f)), 1.0f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
}

core::View Flat(void* p, int64_t n) { return {{static_cast<std::byte*>(p), n}}; }

TEST(ReduceTest, HalfSumIsAccumulatedInFloatAndRoundedOnce) {
  // Pairwise in half, 2048 + 1 rounds back to 2048 twice; in float the sum is 2050, exact.
  std::vector<uint16_t> a = {FloatToHalf(2048)}, b = {FloatToHalf(1)}, c = {FloatToHalf(1)};
  core::View va = Flat(a.data(), 1), vb = Flat(b.data(), 1), vc = Flat(c.data(), 1);
  std::vector<Slice> all = {{&va, 0}, {&vb, 0}, {&vc, 0}};
  ASSERT_TRUE(Reduce(v1::FLOAT16, v1::SUM, 3, all, all, 1).ok());
  EXPECT_EQ(HalfToFloat(a[0]), 2050.0f);
  EXPECT_EQ(HalfToFloat(b[0]), 2050.0f);
  EXPECT_EQ(HalfToFloat(c[0]), 2050.0f);
}

TEST(ReduceTest, BFloat16MeanMinMax) {
  std::vector<uint16_t> a = {FloatToBFloat16(1.5f), FloatToBFloat16(-3)};
  std::vector<uint16_t> b = {FloatToBFloat16(2.5f), FloatToBFloat16(7)};
  core::View va = Flat(a.data(), 2), vb = Flat(b.data(), 2);
  std::vector<Slice> all = {{&va, 0}, {&vb, 0}};
  auto run = [&](v1::ReduceOp op) {
    std::vector<uint16_t> x = a, y = b;
    core::View vx = Flat(x.data(), 2), vy = Flat(y.data(), 2);
    std::vector<Slice> s = {{&vx, 0}, {&vy, 0}};
    EXPECT_TRUE(Reduce(v1::BFLOAT16, op, 2, s, s, 2).ok());
    EXPECT_EQ(x, y);
    return std::vector<float>{BFloat16ToFloat(x[0]), BFloat16ToFloat(x[1])};
  };
  EXPECT_EQ(run(v1::MEAN), (std::vector<float>{2.0f, 2.0f}));
  EXPECT_EQ(run(v1::MIN), (std::vector<float>{1.5f, -3.0f}));
  EXPECT_EQ(run(v1::MAX), (std::vector<float>{2.5f, 7.0f}));
}

TEST(ReduceTest, IntegerMeanTruncatesTowardZero) {
  std::vector<int32_t> a = {-3, 3, 7}, b = {0, 0, 0};
  core::View va = Flat(a.data(), 3), vb = Flat(b.data(), 3);
  std::vector<Slice> all = {{&va, 0}, {&vb, 0}};
  ASSERT_TRUE(Reduce(v1::INT32, v1::MEAN, 2, all, all, 3).ok());
  EXPECT_EQ(a, (std::vector<int32_t>{-1, 1, 3}));
  EXPECT_EQ(b, a);
}

TEST(ReduceTest, SegmentBoundariesMayDifferBetweenMembers) {
  // Member 0 holds 10000 floats in one run; member 1 in runs of 1, 4999, 3 and 4997 elements
  // scattered through a larger buffer. Offsets into the logical array are honoured too.
  constexpr int64_t kN = 10000;
  std::vector<float> a(kN), b(kN + 100);
  for (int64_t i = 0; i < kN; ++i) a[i] = static_cast<float>(i);
  core::View va = Flat(a.data(), kN);
  const int64_t runs[] = {1, 4999, 3, 4997};
  core::View vb;
  int64_t phys = 0, logical = 0;
  for (int64_t len : runs) {
    vb.push_back({reinterpret_cast<std::byte*>(b.data() + phys), len});
    for (int64_t i = 0; i < len; ++i) b[phys + i] = 1000.0f * (logical + i);
    phys += len + 25;  // gaps that must stay untouched
    logical += len;
  }
  std::vector<float> gaps_before = b;
  std::vector<Slice> s = {{&va, 7}, {&vb, 7}};
  ASSERT_TRUE(Reduce(v1::FLOAT32, v1::SUM, 2, s, s, kN - 7).ok());
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(a[i], static_cast<float>(i));  // before the offset
  for (int64_t i = 7; i < kN; ++i) ASSERT_EQ(a[i], 1001.0f * i) << i;
  phys = 0;
  logical = 0;
  for (int64_t len : runs) {
    for (int64_t i = 0; i < len; ++i) {
      const int64_t l = logical + i;
      ASSERT_EQ(b[phys + i], l < 7 ? 1000.0f * l : 1001.0f * l) << l;
    }
    for (int64_t g = 0; g < 25 && phys + len + g < static_cast<int64_t>(b.size()); ++g) {
      ASSERT_EQ(b[phys + len + g], gaps_before[phys + len + g]);
    }
    phys += len + 25;
    logical += len;
  }
}

TEST(CopyTest, CopiesOneSourceToEveryDestinationAcrossDifferentRuns) {
  // The source in runs of 2 and 5 from element 1 on; one destination in runs of 3, 1 and 2,
  // another flat, the third the source itself (left as it is).
  std::vector<double> src = {-1, 1, 2, 3, 4, 5, 6};
  std::vector<double> d1(9, -7), d2(6, -7);
  core::View vs = {{reinterpret_cast<std::byte*>(src.data()), 2},
                   {reinterpret_cast<std::byte*>(src.data() + 2), 5}};
  core::View v1_ = {{reinterpret_cast<std::byte*>(d1.data()), 3},
                    {reinterpret_cast<std::byte*>(d1.data() + 4), 1},
                    {reinterpret_cast<std::byte*>(d1.data() + 6), 2}};
  core::View v2 = Flat(d2.data(), 6);
  const std::vector<Slice> d = {{&v1_, 0}, {&v2, 0}, {&vs, 1}};
  ASSERT_TRUE(Copy(v1::FLOAT64, Slice{&vs, 1}, d, 6).ok());
  EXPECT_EQ(d1, (std::vector<double>{1, 2, 3, -7, 4, -7, 5, 6, -7}));
  EXPECT_EQ(d2, (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(src, (std::vector<double>{-1, 1, 2, 3, 4, 5, 6}));
}

TEST(ReduceTest, OneSourceWithAReductionGoesToEveryDestination) {
  std::vector<double> src = {1, 2, 3}, d1(3), d2(3);
  core::View vs = Flat(src.data(), 3), v1_ = Flat(d1.data(), 3), v2 = Flat(d2.data(), 3);
  std::vector<Slice> s = {{&vs, 0}}, d = {{&v1_, 0}, {&v2, 0}};
  ASSERT_TRUE(Reduce(v1::FLOAT64, v1::MAX, 1, s, d, 3).ok());
  EXPECT_EQ(d1, src);
  EXPECT_EQ(d2, src);
  ASSERT_TRUE(Reduce(v1::FLOAT64, v1::MEAN, 2, s, d, 3).ok());
  EXPECT_EQ(d1, (std::vector<double>{0.5, 1, 1.5}));
  EXPECT_EQ(d2, d1);
}

TEST(ReduceTest, AnOpThatIsNotAReductionFailsInternalNamingItAndWritesNothing) {
  std::vector<float> a = {1, 2}, b = {3, 4}, out = {-1, -1};
  core::View va = Flat(a.data(), 2), vb = Flat(b.data(), 2), vo = Flat(out.data(), 2);
  const std::vector<Slice> srcs = {{&va, 0}, {&vb, 0}}, dsts = {{&vo, 0}};
  const absl::Status unspecified = Reduce(v1::FLOAT32, v1::REDUCE_OP_UNSPECIFIED, 2, srcs, dsts, 2);
  EXPECT_EQ(unspecified.code(), absl::StatusCode::kInternal) << unspecified;
  EXPECT_TRUE(absl::StrContains(unspecified.message(), "reduce op none (0)")) << unspecified;
  const absl::Status unknown = Reduce(v1::FLOAT32, static_cast<v1::ReduceOp>(77), 2, srcs, dsts, 2);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInternal) << unknown;
  EXPECT_TRUE(absl::StrContains(unknown.message(), "(77)")) << unknown;
  EXPECT_EQ(out, (std::vector<float>{-1, -1}));
}

TEST(ReduceTest, AnUnknownDTypeFailsInternalNamingItAndWritesNothing) {
  std::vector<float> a = {1, 2}, out = {-1, -1};
  core::View va = Flat(a.data(), 2), vo = Flat(out.data(), 2);
  const Slice src{&va, 0}, dst{&vo, 0};
  const absl::Status reduced = Reduce(v1::DTYPE_UNSPECIFIED, v1::SUM, 1, {&src, 1}, {&dst, 1}, 2);
  EXPECT_EQ(reduced.code(), absl::StatusCode::kInternal) << reduced;
  EXPECT_TRUE(absl::StrContains(reduced.message(), "dtype unspecified (0)")) << reduced;
  const absl::Status copied = Copy(static_cast<DType>(99), src, {&dst, 1}, 2);
  EXPECT_EQ(copied.code(), absl::StatusCode::kInternal) << copied;
  EXPECT_TRUE(absl::StrContains(copied.message(), "(99)")) << copied;
  EXPECT_EQ(out, (std::vector<float>{-1, -1}));
}

TEST(ReduceTest, ElementsFromNoSourceFailInternal) {
  std::vector<float> out = {-1};
  core::View vo = Flat(out.data(), 1);
  const Slice dst{&vo, 0};
  const absl::Status s = Reduce(v1::FLOAT32, v1::SUM, 1, {}, {&dst, 1}, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(out[0], -1.0f);
  EXPECT_TRUE(Reduce(v1::FLOAT32, v1::SUM, 1, {}, {&dst, 1}, 0).ok());  // nothing to do
}

// Every op over 1-4 sources into fresh destinations, in place into the first source, and into
// destinations that alias later sources (each destination then holds what a reference computes
// from the inputs as they were), for a float and an integer type, across several steps.
template <typename T>
void ExpectEveryAliasingGivesTheReference(DType dtype) {
  constexpr int64_t n = 5000;  // more than one step of the kernel, not a multiple of it
  std::mt19937 rng(7);
  for (v1::ReduceOp op : {v1::SUM, v1::MEAN, v1::MIN, v1::MAX}) {
    for (int sources = 1; sources <= 4; ++sources) {
      for (int layout = 0; layout < 3; ++layout) {
        std::vector<std::vector<T>> in(sources, std::vector<T>(n));
        for (auto& v : in) {
          for (T& x : v) x = static_cast<T>(static_cast<int>(rng() % 2001) - 1000) / T{4};
        }
        std::vector<T> want(n);
        for (int64_t i = 0; i < n; ++i) {
          T acc = in[0][i];
          for (int k = 1; k < sources; ++k) {
            acc = op == v1::MIN   ? std::min(acc, in[k][i])
                  : op == v1::MAX ? std::max(acc, in[k][i])
                                  : static_cast<T>(acc + in[k][i]);
          }
          if (op == v1::MEAN) acc = static_cast<T>(acc / T{3});
          want[i] = acc;
        }
        std::vector<T> fresh1(n), fresh2(n);
        std::vector<core::View> views;
        views.reserve(sources + 2);
        for (auto& v : in) views.push_back(Flat(v.data(), n));
        views.push_back(Flat(fresh1.data(), n));
        views.push_back(Flat(fresh2.data(), n));
        std::vector<Slice> srcs, dsts;
        for (int k = 0; k < sources; ++k) srcs.push_back({&views[k], 0});
        std::vector<T*> check;
        if (layout == 0) {  // fresh destinations
          dsts = {{&views[sources], 0}, {&views[sources + 1], 0}};
          check = {fresh1.data(), fresh2.data()};
        } else if (layout == 1) {  // in place into every source
          for (int k = 0; k < sources; ++k) dsts.push_back({&views[k], 0});
          for (auto& v : in) check.push_back(v.data());
        } else {  // the last source first, then the first source
          dsts = {{&views[sources - 1], 0}, {&views[0], 0}};
          check = {in[sources - 1].data(), in[0].data()};
        }
        ASSERT_TRUE(Reduce(dtype, op, 3, srcs, dsts, n).ok());
        for (T* got : check) {
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(got[i], want[i]) << "op " << op << " sources " << sources << " layout "
                                       << layout << " element " << i;
          }
        }
      }
    }
  }
}

TEST(ReduceTest, EveryOpAndAliasingOfSourcesAndDestinationsGivesTheReference) {
  ExpectEveryAliasingGivesTheReference<float>(v1::FLOAT32);
  ExpectEveryAliasingGivesTheReference<int64_t>(v1::INT64);
}

}  // namespace
}  // namespace gradsync::backend::cpu
