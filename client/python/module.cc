// gradsync._gradsync: the C++ client library for Python trainers (pybind11).
//
// Thin by design: a session (Client), its shared-memory buffers (Buffer, with the buffer
// protocol so torch.frombuffer views them without a copy), op handles (Handle), the job's
// store (pack plans, keys) and the pack planner of common/. Everything that waits releases the
// GIL. Tensors, groups and the optimizer live in the Python package on top of this.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/dtype.h"
#include "common/pack_list.h"

namespace py = pybind11;

namespace gradsync::python {
namespace {

using client::Client;
using client::Op;
using client::OpOptions;
using client::Segment;
using client::SharedBuffer;
using client::StoreClient;

// gradsync.Error: a RuntimeError whose `code` is the status name ("FAILED_PRECONDITION").
PyObject* g_error_type = nullptr;

struct StatusError {
  absl::Status status;
};

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError{status};
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> v) {
  ThrowIfError(v.status());
  return *std::move(v);
}

DType ParseDTypeOrThrow(const std::string& name) { return ValueOrThrow(ParseDType(name)); }

v1::ReduceOp ParseReduceOp(const std::string& name) {
  if (name == "sum") return v1::SUM;
  if (name == "mean") return v1::MEAN;
  if (name == "min") return v1::MIN;
  if (name == "max") return v1::MAX;
  throw StatusError{absl::InvalidArgumentError(
      absl::StrCat("reduce op '", name, "' is not one of sum, mean, min, max"))};
}

OpOptions MakeOptions(const std::string& group, const std::string& name, double timeout_s) {
  OpOptions o;
  o.group = group;
  o.name = name;
  if (timeout_s > 0) o.timeout = absl::Seconds(timeout_s);
  return o;
}

// (buffer_id, byte_offset, count) tuples.
using SegmentTuple = std::tuple<uint64_t, int64_t, int64_t>;
std::vector<Segment> Segments(const std::vector<SegmentTuple>& in) {
  std::vector<Segment> out;
  out.reserve(in.size());
  for (const auto& [id, offset, count] : in) out.push_back({id, offset, count});
  return out;
}

// The session and the job's store, shared by every Buffer and Handle made from it, so it lives
// until the last of them is gone.
struct Session {
  std::unique_ptr<Client> client;
  std::unique_ptr<StoreClient> store;  // the job's store: the root daemon's, else the local one
  std::string job;
};

struct Buffer {
  std::shared_ptr<Session> session;
  std::unique_ptr<SharedBuffer> buffer;
};

struct Handle {
  std::shared_ptr<Session> session;
  Op op;
};

std::shared_ptr<Session> Open(const std::string& target, const std::string& job, int world_size,
                              int rank, int local_rank, int local_world_size,
                              const std::string& root_address, const std::string& token,
                              double rpc_timeout_s) {
  client::Placement placement{job, world_size, rank, local_rank, local_world_size, root_address};
  client::ClientOptions options;
  options.token = token;
  if (rpc_timeout_s > 0) options.rpc_timeout = absl::Seconds(rpc_timeout_s);
  auto session = std::make_shared<Session>();
  session->job = job;
  {
    py::gil_scoped_release release;
    session->client = ValueOrThrow(Client::Connect(target, placement, options));
    const std::string store_target = root_address.empty() ? target : root_address;
    session->store = std::make_unique<StoreClient>(client::Connect(store_target, options), options);
  }
  return session;
}

Handle Submit(const std::shared_ptr<Session>& s, Op op) { return Handle{s, std::move(op)}; }

py::dict PackListToPython(const v1::PackList& plan) {
  py::list packs;
  for (const v1::Pack& p : plan.packs()) {
    py::list shapes;
    for (const v1::TensorSpec& t : p.shapes()) {
      shapes.append(py::cast(std::vector<int64_t>(t.shape().begin(), t.shape().end())));
    }
    py::dict d;
    d["dtype"] = std::string(DTypeName(p.dtype()));
    d["indices"] = std::vector<int32_t>(p.indices().begin(), p.indices().end());
    d["shapes"] = shapes;
    d["bytes"] = p.bytes();
    packs.append(d);
  }
  py::dict out;
  out["packs"] = packs;
  out["threshold_bytes"] = plan.threshold_bytes();
  out["first_alone"] = plan.first_alone();
  return out;
}

v1::PackList PackListFromPython(const py::dict& d) {
  v1::PackList plan;
  plan.set_threshold_bytes(d["threshold_bytes"].cast<int64_t>());
  plan.set_first_alone(d["first_alone"].cast<int32_t>());
  for (const py::handle& h : d["packs"].cast<py::list>()) {
    const py::dict p = h.cast<py::dict>();
    v1::Pack* pack = plan.add_packs();
    const DType dtype = ParseDTypeOrThrow(p["dtype"].cast<std::string>());
    pack->set_dtype(dtype);
    pack->set_bytes(p["bytes"].cast<int64_t>());
    for (int32_t i : p["indices"].cast<std::vector<int32_t>>()) pack->add_indices(i);
    for (const auto& shape : p["shapes"].cast<std::vector<std::vector<int64_t>>>()) {
      v1::TensorSpec* spec = pack->add_shapes();
      spec->set_dtype(dtype);
      for (int64_t dim : shape) spec->add_shape(dim);
    }
  }
  return plan;
}

// grads: (index, dtype name, shape) in backward order.
py::dict PlanPacksPy(
    const std::vector<std::tuple<int32_t, std::string, std::vector<int64_t>>>& grads,
    int64_t threshold_bytes, int32_t first_alone) {
  std::vector<GradInfo> infos;
  for (const auto& [index, dtype, shape] : grads) {
    GradInfo g;
    g.index = index;
    g.spec.set_dtype(ParseDTypeOrThrow(dtype));
    for (int64_t dim : shape) g.spec.add_shape(dim);
    infos.push_back(std::move(g));
  }
  PackOptions options;
  options.threshold_bytes = threshold_bytes;
  options.first_alone = first_alone;
  return PackListToPython(ValueOrThrow(PlanPacks(infos, options)));
}

}  // namespace
}  // namespace gradsync::python

PYBIND11_MODULE(_gradsync, m) {
  using namespace gradsync;          // NOLINT
  using namespace gradsync::python;  // NOLINT
  m.doc() = "gradsync client library (C++), for the gradsync Python package";

  static py::exception<StatusError> error(m, "Error", PyExc_RuntimeError);
  g_error_type = error.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const std::string code = absl::StatusCodeToString(e.status.code());
      py::object instance = py::reinterpret_borrow<py::object>(g_error_type)(
          absl::StrCat(code, ": ", e.status.message()));
      instance.attr("code") = code;
      instance.attr("detail") = std::string(e.status.message());
      PyErr_SetObject(g_error_type, instance.ptr());
    }
  });

  py::class_<Buffer>(m, "Buffer", py::buffer_protocol(),
                     "Shared memory registered with the daemon; a writable buffer of bytes")
      .def_property_readonly("id", [](const Buffer& b) { return b.buffer->id(); })
      .def_property_readonly("nbytes", [](const Buffer& b) { return b.buffer->size(); })
      .def_property_readonly(
          "address", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.buffer->data()); })
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.buffer->data(), 1, py::format_descriptor<uint8_t>::format(),
                               b.buffer->size());
      });

  py::class_<Handle>(m, "Handle", "An op in flight")
      .def(
          "wait",
          [](Handle& h) {
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = h.op.Wait();
            }
            ThrowIfError(s);
          },
          "Blocks (GIL released) until the daemon answers; raises gradsync.Error on failure")
      .def("done", [](Handle& h) { return h.op.Done(); })
      .def_property_readonly("seq", [](Handle& h) { return h.op.seq(); });

  py::class_<Session, std::shared_ptr<Session>>(m, "Client", "A trainer's session with gradsyncd")
      .def(py::init(&Open), py::arg("target"), py::arg("job"), py::arg("world_size"),
           py::arg("rank"), py::arg("local_rank"), py::arg("local_world_size"),
           py::arg("root_address") = "", py::arg("token") = "", py::arg("rpc_timeout_s") = 0.0)
      .def(
          "create_buffer",
          [](const std::shared_ptr<Session>& s, int64_t nbytes) {
            py::gil_scoped_release release;
            return Buffer{s, ValueOrThrow(s->client->CreateBuffer(nbytes))};
          },
          py::arg("nbytes"))
      .def(
          "destroy_buffer",
          [](const std::shared_ptr<Session>& s, Buffer& b) {
            if (!b.buffer) return;
            // The mapping stays until the Buffer object goes (tensors may still view it).
            const uint64_t id = b.buffer->id();
            py::gil_scoped_release release;
            ThrowIfError(s->client->DeregisterBuffer(id));
          },
          py::arg("buffer"))
      .def(
          "all_reduce",
          [](const std::shared_ptr<Session>& s, const std::string& dtype, const std::string& op,
             const std::vector<SegmentTuple>& data, const std::string& group,
             const std::string& name, double timeout_s) {
            const DType d = ParseDTypeOrThrow(dtype);
            const v1::ReduceOp r = ParseReduceOp(op);
            py::gil_scoped_release release;
            return Submit(s, s->client->AllReduceAsync(d, r, Segments(data),
                                                       MakeOptions(group, name, timeout_s)));
          },
          py::arg("dtype"), py::arg("op"), py::arg("data"), py::arg("group") = "world",
          py::arg("name") = "", py::arg("timeout_s") = 0.0)
      .def(
          "broadcast",
          [](const std::shared_ptr<Session>& s, const std::string& dtype, int root,
             const std::vector<SegmentTuple>& data, const std::string& group,
             const std::string& name, double timeout_s) {
            const DType d = ParseDTypeOrThrow(dtype);
            py::gil_scoped_release release;
            return Submit(s, s->client->BroadcastAsync(d, root, Segments(data),
                                                       MakeOptions(group, name, timeout_s)));
          },
          py::arg("dtype"), py::arg("root"), py::arg("data"), py::arg("group") = "world",
          py::arg("name") = "", py::arg("timeout_s") = 0.0)
      .def(
          "barrier",
          [](const std::shared_ptr<Session>& s, const std::string& group, const std::string& name,
             double timeout_s) {
            py::gil_scoped_release release;
            return Submit(s, s->client->BarrierAsync(MakeOptions(group, name, timeout_s)));
          },
          py::arg("group") = "world", py::arg("name") = "", py::arg("timeout_s") = 0.0)
      .def(
          "all_gather",
          [](const std::shared_ptr<Session>& s, const std::string& dtype,
             const std::vector<SegmentTuple>& input, const std::vector<SegmentTuple>& output,
             const std::string& group, const std::string& name, double timeout_s) {
            const DType d = ParseDTypeOrThrow(dtype);
            py::gil_scoped_release release;
            return Submit(s, s->client->AllGatherAsync(d, Segments(input), Segments(output),
                                                       MakeOptions(group, name, timeout_s)));
          },
          py::arg("dtype"), py::arg("input"), py::arg("output"), py::arg("group") = "world",
          py::arg("name") = "", py::arg("timeout_s") = 0.0)
      .def(
          "reduce_scatter",
          [](const std::shared_ptr<Session>& s, const std::string& dtype, const std::string& op,
             const std::vector<SegmentTuple>& input, const std::vector<SegmentTuple>& output,
             const std::string& group, const std::string& name, double timeout_s) {
            const DType d = ParseDTypeOrThrow(dtype);
            const v1::ReduceOp r = ParseReduceOp(op);
            py::gil_scoped_release release;
            return Submit(s, s->client->ReduceScatterAsync(d, r, Segments(input), Segments(output),
                                                           MakeOptions(group, name, timeout_s)));
          },
          py::arg("dtype"), py::arg("op"), py::arg("input"), py::arg("output"),
          py::arg("group") = "world", py::arg("name") = "", py::arg("timeout_s") = 0.0)
      .def(
          "set_pack_list",
          [](const std::shared_ptr<Session>& s, const std::string& group, const py::dict& plan) {
            const v1::PackList p = PackListFromPython(plan);
            py::gil_scoped_release release;
            ThrowIfError(s->store->SetPackList(s->job, group, p));
          },
          py::arg("group"), py::arg("plan"))
      .def(
          "get_pack_list",
          [](const std::shared_ptr<Session>& s, const std::string& group, double timeout_s) {
            v1::PackList p;
            {
              py::gil_scoped_release release;
              p = ValueOrThrow(
                  s->store->GetPackList(s->job, group, absl::Now() + absl::Seconds(timeout_s)));
            }
            return PackListToPython(p);
          },
          py::arg("group"), py::arg("timeout_s"))
      .def(
          "store_set",
          [](const std::shared_ptr<Session>& s, const std::string& key, const py::bytes& value) {
            std::string v = value;
            py::gil_scoped_release release;
            ThrowIfError(s->store->Set(s->job, key, std::move(v)));
          },
          py::arg("key"), py::arg("value"))
      .def(
          "store_add",
          [](const std::shared_ptr<Session>& s, const std::string& key, int64_t delta) {
            py::gil_scoped_release release;
            return ValueOrThrow(s->store->Add(s->job, key, delta));
          },
          py::arg("key"), py::arg("delta"))
      .def(
          "store_get",
          [](const std::shared_ptr<Session>& s, const std::string& key, double timeout_s) {
            std::vector<std::string> v;
            {
              py::gil_scoped_release release;
              v = ValueOrThrow(
                  s->store->WaitBlocking(s->job, {key}, absl::Now() + absl::Seconds(timeout_s)));
            }
            return py::bytes(v.at(0));
          },
          py::arg("key"), py::arg("timeout_s"))
      .def_property_readonly("job", [](const Session& s) { return s.job; })
      .def_property_readonly("default_op_timeout_s", [](const Session& s) {
        return absl::ToDoubleSeconds(s.client->default_op_timeout());
      });

  m.def("plan_packs", &PlanPacksPy, py::arg("grads"), py::arg("threshold_bytes"),
        py::arg("first_alone") = 0,
        "The pack planner of common/: grads are (index, dtype, shape) in backward order");
  m.def("dtype_size", [](const std::string& dtype) { return DTypeSize(ParseDTypeOrThrow(dtype)); });
}
