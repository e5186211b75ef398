// Implementation of kernels.h: the element-wise reduce over segmented views, and the float16 and
// bfloat16 conversions.

#include "daemon/backend/cpu/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gradsync::backend::cpu {
namespace {

// Elements per step: the accumulator and the converted result stay in L1/L2 while they are
// written back to every destination.
constexpr int64_t kStep = 2048;

// Where a slice currently is: run index and element offset inside that run.
class Cursor {
 public:
  Cursor(const Slice& slice, int64_t esize) : view_(*slice.view), esize_(esize) {
    int64_t skip = slice.offset;
    while (run_ < view_.size() && skip >= view_[run_].count) {
      skip -= view_[run_].count;
      ++run_;
    }
    pos_ = skip;
    SkipEmpty();
  }
  int64_t Available() const { return view_[run_].count - pos_; }
  std::byte* Ptr() const { return view_[run_].data + pos_ * esize_; }
  void Advance(int64_t n) {
    pos_ += n;
    if (pos_ == view_[run_].count) {
      ++run_;
      pos_ = 0;
      SkipEmpty();
    }
  }

 private:
  void SkipEmpty() {
    while (run_ < view_.size() && view_[run_].count == 0) ++run_;
  }
  const core::View& view_;
  const int64_t esize_;
  size_t run_ = 0;
  int64_t pos_ = 0;
};

struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

template <typename T>
struct Traits {
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc v) { return v; }
};
template <>
struct Traits<F16> {
  using Acc = float;
  static float Load(F16 v) { return HalfToFloat(v.bits); }
  static F16 Store(float v) { return F16{FloatToHalf(v)}; }
};
template <>
struct Traits<BF16> {
  using Acc = float;
  static float Load(BF16 v) { return BFloat16ToFloat(v.bits); }
  static BF16 Store(float v) { return BF16{FloatToBFloat16(v)}; }
};

// How elements combine, decided once per Reduce from the wire's op (MEAN sums, then divides):
// the loops switch over it with every case named and no default.
enum class Combiner { kSum, kMin, kMax };

absl::StatusOr<Combiner> CombinerOf(v1::ReduceOp op) {
  switch (op) {
    case v1::SUM:
    case v1::MEAN:
      return Combiner::kSum;
    case v1::MIN:
      return Combiner::kMin;
    case v1::MAX:
      return Combiner::kMax;
    default:
      return absl::InternalError(absl::StrCat("reduce: reduce op ", ReduceOpName(op), " (",
                                              static_cast<int>(op), ") is not a reduction"));
  }
}

absl::Status UnknownDType(absl::string_view what, DType dtype) {
  return absl::InternalError(absl::StrCat(what, ": no kernel for dtype ", DTypeName(dtype), " (",
                                          static_cast<int>(dtype), ")"));
}

// d[i] = a[i] op b[i] (d may be a, element for element).
template <typename T>
void Combine(Combiner c, T* d, const T* a, const T* b, int64_t n) {
  switch (c) {
    case Combiner::kSum:
      for (int64_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
      return;
    case Combiner::kMin:
      for (int64_t i = 0; i < n; ++i) d[i] = std::min(a[i], b[i]);
      return;
    case Combiner::kMax:
      for (int64_t i = 0; i < n; ++i) d[i] = std::max(a[i], b[i]);
      return;
  }
}

// One step (len elements) straight into the first destination (one pass over it, no
// accumulator), then copied to the others. Only for a type reduced in itself (not a half type)
// and no source after the first at that destination (sources alias destinations only element
// for element, so comparing where the step starts is enough; the first is read before each
// write). False when it does not apply.
template <typename T>
bool ReduceDirect(Combiner c, bool mean, int64_t divisor, const std::vector<Cursor>& in,
                  const std::vector<Cursor>& out, int64_t len) {
  if constexpr (!std::is_same_v<typename Traits<T>::Acc, T>) {
    return false;
  } else {
    for (size_t k = 1; k < in.size(); ++k) {
      if (in[k].Ptr() == out[0].Ptr()) return false;
    }
    T* const d = reinterpret_cast<T*>(out[0].Ptr());
    const T* const s0 = reinterpret_cast<const T*>(in[0].Ptr());
    if (in.size() == 1) {
      if (d != s0) std::memmove(d, s0, len * sizeof(T));
    } else {
      Combine(c, d, s0, reinterpret_cast<const T*>(in[1].Ptr()), len);
    }
    for (size_t k = 2; k < in.size(); ++k) {
      Combine(c, d, d, reinterpret_cast<const T*>(in[k].Ptr()), len);
    }
    if (mean && divisor > 1) {
      const T dv = static_cast<T>(divisor);
      for (int64_t i = 0; i < len; ++i) d[i] /= dv;
    }
    for (size_t k = 1; k < out.size(); ++k) {
      if (out[k].Ptr() != out[0].Ptr()) std::memcpy(out[k].Ptr(), d, len * sizeof(T));
    }
    return true;
  }
}

template <typename T>
void ReduceTyped(Combiner c, bool mean, int64_t divisor, absl::Span<const Slice> srcs,
                 absl::Span<const Slice> dsts, int64_t n) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  constexpr int64_t esize = sizeof(T);
  std::vector<Cursor> in, out;
  in.reserve(srcs.size());
  out.reserve(dsts.size());
  for (const Slice& s : srcs) in.emplace_back(s, esize);
  for (const Slice& d : dsts) out.emplace_back(d, esize);
  Acc acc[kStep];
  T result[std::is_same_v<Acc, T> ? 1 : kStep];
  const bool copy_only = srcs.size() == 1 && !mean;
  while (n > 0) {
    int64_t len = std::min(n, kStep);
    for (const Cursor& c : in) len = std::min(len, c.Available());
    for (const Cursor& c : out) len = std::min(len, c.Available());
    const std::byte* first = in[0].Ptr();
    if (copy_only) {
      for (const Cursor& c : out) {
        if (c.Ptr() != first) std::memmove(c.Ptr(), first, len * esize);
      }
    } else if (ReduceDirect<T>(c, mean, divisor, in, out, len)) {
    } else {
      const T* s0 = reinterpret_cast<const T*>(first);
      for (int64_t i = 0; i < len; ++i) acc[i] = Tr::Load(s0[i]);
      for (size_t k = 1; k < in.size(); ++k) {
        const T* s = reinterpret_cast<const T*>(in[k].Ptr());
        switch (c) {
          case Combiner::kSum:
            for (int64_t i = 0; i < len; ++i) acc[i] += Tr::Load(s[i]);
            break;
          case Combiner::kMin:
            for (int64_t i = 0; i < len; ++i) acc[i] = std::min(acc[i], Tr::Load(s[i]));
            break;
          case Combiner::kMax:
            for (int64_t i = 0; i < len; ++i) acc[i] = std::max(acc[i], Tr::Load(s[i]));
            break;
        }
      }
      if (mean && divisor > 1) {
        const Acc d = static_cast<Acc>(divisor);
        for (int64_t i = 0; i < len; ++i) acc[i] /= d;
      }
      const void* from = acc;
      if constexpr (!std::is_same_v<Acc, T>) {
        for (int64_t i = 0; i < len; ++i) result[i] = Tr::Store(acc[i]);
        from = result;
      }
      for (const Cursor& c : out) std::memcpy(c.Ptr(), from, len * esize);
    }
    for (Cursor& c : in) c.Advance(len);
    for (Cursor& c : out) c.Advance(len);
    n -= len;
  }
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000 | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    // Subnormal: value = mant * 2^-24.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffff;
  if (abs >= 0x7f800000) {  // inf or nan (keep nan quiet)
    return sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0);
  }
  if (abs >= 0x477ff000) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000) {                       // below the smallest normal half (2^-14)
    // Subnormal half: round abs / 2^-24 to nearest even.
    const float v = BitsFloat(abs) * 16777216.0f;  // exact scaling by 2^24
    const float r = std::nearbyint(v);             // default rounding mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet nan
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

absl::Status Reduce(DType dtype, v1::ReduceOp op, int64_t divisor, absl::Span<const Slice> srcs,
                    absl::Span<const Slice> dsts, int64_t n) {
  const absl::StatusOr<Combiner> c = CombinerOf(op);
  if (!c.ok()) return c.status();
  if (DTypeSize(dtype) <= 0) return UnknownDType("reduce", dtype);
  if (n <= 0 || dsts.empty()) return absl::OkStatus();
  if (srcs.empty()) {
    return absl::InternalError(absl::StrCat("reduce: ", n, " elements from no source"));
  }
  const bool mean = op == v1::MEAN;
  switch (dtype) {
    case v1::FLOAT32:
      ReduceTyped<float>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::FLOAT64:
      ReduceTyped<double>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::FLOAT16:
      ReduceTyped<F16>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::BFLOAT16:
      ReduceTyped<BF16>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::INT32:
      ReduceTyped<int32_t>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::INT64:
      ReduceTyped<int64_t>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::UINT8:
      ReduceTyped<uint8_t>(*c, mean, divisor, srcs, dsts, n);
      break;
    case v1::INT8:
      ReduceTyped<int8_t>(*c, mean, divisor, srcs, dsts, n);
      break;
    default:  // a dtype with a size (DTypeSize) but no kernel here
      return UnknownDType("reduce", dtype);
  }
  return absl::OkStatus();
}

absl::Status Copy(DType dtype, const Slice& src, absl::Span<const Slice> dsts, int64_t n) {
  const int64_t esize = DTypeSize(dtype);
  if (esize <= 0) return UnknownDType("copy", dtype);
  if (n <= 0 || dsts.empty()) return absl::OkStatus();
  Cursor in(src, esize);
  std::vector<Cursor> out;
  out.reserve(dsts.size());
  for (const Slice& d : dsts) out.emplace_back(d, esize);
  while (n > 0) {
    int64_t len = std::min(n, in.Available());
    for (const Cursor& c : out) len = std::min(len, c.Available());
    for (const Cursor& c : out) {
      if (c.Ptr() != in.Ptr()) std::memmove(c.Ptr(), in.Ptr(), static_cast<size_t>(len * esize));
    }
    in.Advance(len);
    for (Cursor& c : out) c.Advance(len);
    n -= len;
  }
  return absl::OkStatus();
}

}  // namespace gradsync::backend::cpu
