// Request resolution (see resolve.h).
#include "daemon/core/resolve.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/group.h"
#include "common/status_macros.h"
#include "daemon/core/engine.h"

namespace gradsync::core::internal {
namespace {

constexpr size_t kMaxNameLength = 256;

// A byte range of one registered buffer that an op names.
struct Extent {
  uint64_t buffer;
  int64_t begin, end;
};

// INVALID_ARGUMENT with the op's label in front.
struct Invalid {
  const std::string& label;
  template <typename... Parts>
  absl::Status operator()(const Parts&... parts) const {
    return absl::InvalidArgumentError(absl::StrCat(label, parts...));
  }
};

// The op's scalar fields, checked, into the fingerprint; the element size (1 for a barrier).
absl::StatusOr<int64_t> CheckFields(const v1::OpRequest& op, const EngineOptions& options,
                                    const Invalid& invalid, Fingerprint& fp) {
  if (!v1::OpKind_IsValid(op.kind()) || op.kind() == v1::OP_KIND_UNSPECIFIED) {
    return invalid("unknown op kind ", static_cast<int>(op.kind()));
  }
  const bool barrier = op.kind() == v1::BARRIER;
  const int64_t esize = barrier ? 1 : DTypeSize(op.dtype());
  if (!barrier) {
    if (esize == 0) return invalid("unknown dtype ", static_cast<int>(op.dtype()));
    fp.dtype = op.dtype();
  }
  if (Reduces(op.kind())) {
    if (op.reduce_op() < v1::SUM || op.reduce_op() > v1::MAX) {
      return invalid("needs a reduce_op (sum, mean, min, max); got ",
                     static_cast<int>(op.reduce_op()));
    }
    fp.reduce_op = op.reduce_op();
  }
  if (op.name().size() > kMaxNameLength) {
    return invalid("name longer than ", kMaxNameLength, " characters");
  }
  fp.name = op.name();
  if (op.timeout_ms() < 0 || absl::Milliseconds(op.timeout_ms()) > options.max_op_timeout) {
    return invalid("timeout_ms ", op.timeout_ms(), " is not in [0, ",
                   absl::ToInt64Milliseconds(options.max_op_timeout), "]");
  }
  if (op.input_size() + op.output_size() > options.max_segments_per_op) {
    return invalid(op.input_size() + op.output_size(), " segments; at most ",
                   options.max_segments_per_op, " per op");
  }
  return esize;
}

// The group's members, this rank's place among them, a broadcast's root.
absl::Status ResolveGroup(const v1::OpRequest& op, const Job& job, int rank, const Invalid& invalid,
                          Arrival& a) {
  a.group_key = op.group().empty() ? std::string(kWorldGroup) : op.group();
  if (a.group_key == kWorldGroup) {
    for (int r = 0; r < job.world_size; ++r) a.members.push_back(r);
  } else {
    auto members = ParseGroupKey(a.group_key);
    if (!members.ok()) return invalid(members.status().message());
    a.members = *std::move(members);
    if (a.members.back() >= job.world_size) {
      return invalid("group names rank ", a.members.back(), " but the job has world_size ",
                     job.world_size);
    }
  }
  auto me = std::lower_bound(a.members.begin(), a.members.end(), rank);
  if (me == a.members.end() || *me != rank) {
    return invalid("rank ", rank, " is not a member of the group");
  }
  a.group_rank = static_cast<int>(me - a.members.begin());
  const int size = static_cast<int>(a.members.size());
  if (op.kind() == v1::BROADCAST) {
    if (op.root() < 0 || op.root() >= size) {
      return invalid("root ", op.root(), " is not a group rank in [0, ", size, ")");
    }
    a.fp.root = op.root();
  }
  return absl::OkStatus();
}

// `segments` against the session's buffers, into `view` (and their extents, pins, count).
absl::Status ResolveSegments(Session& session,
                             const google::protobuf::RepeatedPtrField<v1::Segment>& segments,
                             v1::DType dtype, int64_t esize, const std::string& label,
                             const Invalid& invalid, View& view, std::vector<Extent>& extents,
                             Arrival& a, int64_t& total) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
  for (const v1::Segment& seg : segments) {
    auto it = session.buffers.find(seg.buffer_id());
    if (it == session.buffers.end()) {
      return absl::NotFoundError(
          absl::StrCat(label, "buffer ", seg.buffer_id(), " is not registered in this session"));
    }
    const Session::Buffer& buffer = it->second;
    if (buffer.dtype != v1::DTYPE_UNSPECIFIED && buffer.dtype != dtype) {
      return invalid("buffer ", seg.buffer_id(), " was registered as ", DTypeName(buffer.dtype),
                     " but the op is ", DTypeName(dtype));
    }
    const int64_t size_bytes = buffer.mapping->size();
    if (seg.count() < 0 || seg.byte_offset() < 0 || seg.byte_offset() % esize != 0 ||
        seg.byte_offset() > size_bytes || seg.count() > (size_bytes - seg.byte_offset()) / esize) {
      return invalid("segment (buffer ", seg.buffer_id(), ", byte_offset ", seg.byte_offset(),
                     ", count ", seg.count(), ") is outside the buffer's ", size_bytes,
                     " bytes or not aligned to the ", esize, "-byte element");
    }
    if (seg.count() == 0) continue;
    view.push_back({buffer.mapping->data() + seg.byte_offset(), seg.count(), buffer.mapping.get()});
    extents.push_back(
        {seg.buffer_id(), seg.byte_offset(), seg.byte_offset() + seg.count() * esize});
    if (a.pins.empty() || a.pins.back() != buffer.mapping) {
      // A device buffer's pin also holds its events until the op has settled on the device.
      a.pins.push_back(
          buffer.use == nullptr
              ? buffer.mapping
              : std::shared_ptr<MappedBuffer>(std::make_shared<Session::DeviceHold>(buffer.use),
                                              buffer.mapping.get()));
    }
    total += seg.count();
  }
  return absl::OkStatus();
}

absl::Status CheckOverlaps(std::vector<Extent>& extents, const Invalid& invalid) {
  std::sort(extents.begin(), extents.end(), [](const Extent& x, const Extent& y) {
    return x.buffer != y.buffer ? x.buffer < y.buffer : x.begin < y.begin;
  });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].buffer == extents[i - 1].buffer && extents[i].begin < extents[i - 1].end) {
      return invalid("segments overlap in buffer ", extents[i].buffer, " (bytes [",
                     extents[i - 1].begin, ", ", extents[i - 1].end, ") and [", extents[i].begin,
                     ", ", extents[i].end, "))");
    }
  }
  return absl::OkStatus();
}

// The counts each kind needs of its input and output; the fingerprint's count, the op's bytes.
absl::Status CheckShapes(const v1::OpRequest& op, int64_t in_count, int64_t out_count,
                         int64_t esize, const Invalid& invalid, Arrival& a) {
  const int size = static_cast<int>(a.members.size());
  switch (op.kind()) {
    case v1::ALL_REDUCE:
    case v1::BROADCAST:
      if (op.output_size() > 0) return invalid("works in place on `input`; `output` must be empty");
      a.fp.count = in_count;
      a.bytes = in_count * esize;
      break;
    case v1::BARRIER:
      if (op.input_size() + op.output_size() > 0) return invalid("takes no buffers");
      break;
    case v1::ALL_GATHER:
      if (out_count != in_count * size) {
        return invalid("output has ", out_count, " elements; needs input count ", in_count,
                       " x group size ", size);
      }
      a.fp.count = in_count;
      a.bytes = out_count * esize;
      break;
    case v1::REDUCE_SCATTER:
      if (in_count != out_count * size) {
        return invalid("input has ", in_count, " elements; needs output count ", out_count,
                       " x group size ", size);
      }
      a.fp.count = out_count;
      a.bytes = in_count * esize;
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

// The data plane: where the buffers live, all of them in one place.
absl::Status ResolvePlane(const Invalid& invalid, Arrival& a) {
  for (const View* view : {&a.input, &a.output}) {
    for (const Run& run : *view) {
      if (run.buffer == nullptr) continue;  // unit tests' views
      const Plane plane = run.buffer->device() >= 0 ? Plane::kDevice : Plane::kHost;
      if (a.plane.has_value() && *a.plane != plane) {
        return invalid("an op takes host or device buffers, not both");
      }
      a.plane = plane;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Arrival> Resolve(Session& session, const v1::OpRequest& op,
                                const EngineOptions& options) {
  const Job& job = *session.job;
  Arrival a;
  a.fp.kind = op.kind();
  const std::string label =
      absl::StrCat(OpLabel(op.kind(), job.id, op.group()), " rank=", session.rank, ": ");
  const Invalid invalid{label};
  absl::StatusOr<int64_t> esize = CheckFields(op, options, invalid, a.fp);
  if (!esize.ok()) return esize.status();
  GRADSYNC_RETURN_IF_ERROR(ResolveGroup(op, job, session.rank, invalid, a));
  std::vector<Extent> extents;
  int64_t in_count = 0, out_count = 0;
  {
    absl::MutexLock lock(&session.mu);
    if (session.ended) return absl::FailedPreconditionError(absl::StrCat(label, "session ended"));
    GRADSYNC_RETURN_IF_ERROR(ResolveSegments(session, op.input(), op.dtype(), *esize, label,
                                             invalid, a.input, extents, a, in_count));
    GRADSYNC_RETURN_IF_ERROR(ResolveSegments(session, op.output(), op.dtype(), *esize, label,
                                             invalid, a.output, extents, a, out_count));
  }
  GRADSYNC_RETURN_IF_ERROR(CheckOverlaps(extents, invalid));
  GRADSYNC_RETURN_IF_ERROR(CheckShapes(op, in_count, out_count, *esize, invalid, a));
  GRADSYNC_RETURN_IF_ERROR(ResolvePlane(invalid, a));
  a.timeout =
      op.timeout_ms() > 0 ? absl::Milliseconds(op.timeout_ms()) : options.default_op_timeout;
  a.deadline = absl::Now() + a.timeout;
  return a;
}

}  // namespace gradsync::core::internal
