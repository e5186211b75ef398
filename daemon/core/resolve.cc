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

}  // namespace

absl::StatusOr<Arrival> Resolve(Session& session, const v1::OpRequest& op,
                                const EngineOptions& options) {
  const Job& job = *session.job;
  Arrival a;
  Fingerprint& fp = a.fp;
  fp.kind = op.kind();
  const std::string label =
      absl::StrCat(OpLabel(op.kind(), job.id, op.group()), " rank=", session.rank, ": ");
  auto invalid = [&label](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(label, parts...));
  };
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

  // Group and membership.
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
  auto me = std::lower_bound(a.members.begin(), a.members.end(), session.rank);
  if (me == a.members.end() || *me != session.rank) {
    return invalid("rank ", session.rank, " is not a member of the group");
  }
  a.group_rank = static_cast<int>(me - a.members.begin());
  const int size = static_cast<int>(a.members.size());
  if (op.kind() == v1::BROADCAST) {
    if (op.root() < 0 || op.root() >= size) {
      return invalid("root ", op.root(), " is not a group rank in [0, ", size, ")");
    }
    fp.root = op.root();
  }

  // Segments against this session's buffers.
  std::vector<Extent> extents;
  int64_t in_count = 0, out_count = 0;
  {
    absl::MutexLock lock(&session.mu);
    if (session.ended) return absl::FailedPreconditionError(absl::StrCat(label, "session ended"));
    auto resolve = [&](const google::protobuf::RepeatedPtrField<v1::Segment>& segments, View& view,
                       int64_t& total) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) -> absl::Status {
      for (const v1::Segment& seg : segments) {
        auto it = session.buffers.find(seg.buffer_id());
        if (it == session.buffers.end()) {
          return absl::NotFoundError(absl::StrCat(label, "buffer ", seg.buffer_id(),
                                                  " is not registered in this session"));
        }
        const Session::Buffer& buffer = it->second;
        if (buffer.dtype != v1::DTYPE_UNSPECIFIED && buffer.dtype != op.dtype()) {
          return invalid("buffer ", seg.buffer_id(), " was registered as ", DTypeName(buffer.dtype),
                         " but the op is ", DTypeName(op.dtype()));
        }
        const int64_t size_bytes = buffer.mapping->size();
        if (seg.count() < 0 || seg.byte_offset() < 0 || seg.byte_offset() % esize != 0 ||
            seg.byte_offset() > size_bytes ||
            seg.count() > (size_bytes - seg.byte_offset()) / esize) {
          return invalid("segment (buffer ", seg.buffer_id(), ", byte_offset ", seg.byte_offset(),
                         ", count ", seg.count(), ") is outside the buffer's ", size_bytes,
                         " bytes or not aligned to the ", esize, "-byte element");
        }
        if (seg.count() == 0) continue;
        view.push_back(
            {buffer.mapping->data() + seg.byte_offset(), seg.count(), buffer.mapping.get()});
        extents.push_back(
            {seg.buffer_id(), seg.byte_offset(), seg.byte_offset() + seg.count() * esize});
        if (a.pins.empty() || a.pins.back() != buffer.mapping) a.pins.push_back(buffer.mapping);
        total += seg.count();
      }
      return absl::OkStatus();
    };
    GRADSYNC_RETURN_IF_ERROR(resolve(op.input(), a.input, in_count));
    GRADSYNC_RETURN_IF_ERROR(resolve(op.output(), a.output, out_count));
  }
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

  switch (op.kind()) {
    case v1::ALL_REDUCE:
    case v1::BROADCAST:
      if (op.output_size() > 0) return invalid("works in place on `input`; `output` must be empty");
      fp.count = in_count;
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
      fp.count = in_count;
      a.bytes = out_count * esize;
      break;
    case v1::REDUCE_SCATTER:
      if (in_count != out_count * size) {
        return invalid("input has ", in_count, " elements; needs output count ", out_count,
                       " x group size ", size);
      }
      fp.count = out_count;
      a.bytes = in_count * esize;
      break;
    default:
      break;
  }
  // The data plane: where the buffers live, all of them in one place.
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

  a.timeout =
      op.timeout_ms() > 0 ? absl::Milliseconds(op.timeout_ms()) : options.default_op_timeout;
  a.deadline = absl::Now() + a.timeout;
  return a;
}

}  // namespace gradsync::core::internal
