// The C ABI of client/gradsync.h over the C++ client. No exception or C++ type crosses it.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/gradsync.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/dtype.h"
#include "common/elastic_records.h"
#include "common/job_id.h"
#include "common/pack_list.h"
#include "common/tls.h"
#include "google/protobuf/util/json_util.h"
#include "gradsync/v1/gradsync.pb.h"
#include "gradsync/v1/types.pb.h"

// gradsync.h restates the wire's enums for C (and _native.py for Python, checked by
// tests/python/test_api_surface.py): each constant must be the proto's value, and the proto
// must have no value the header lacks (its largest is the header's last). The op kind is not
// restated: each op has its own function.
#define GRADSYNC_CHECK_ENUM(c_value, proto_value)                           \
  static_assert(static_cast<int>(c_value) == static_cast<int>(proto_value), \
                "gradsync.h: " #c_value " is not " #proto_value " of the wire")
GRADSYNC_CHECK_ENUM(GS_FLOAT32, gradsync::v1::FLOAT32);
GRADSYNC_CHECK_ENUM(GS_FLOAT64, gradsync::v1::FLOAT64);
GRADSYNC_CHECK_ENUM(GS_FLOAT16, gradsync::v1::FLOAT16);
GRADSYNC_CHECK_ENUM(GS_BFLOAT16, gradsync::v1::BFLOAT16);
GRADSYNC_CHECK_ENUM(GS_INT32, gradsync::v1::INT32);
GRADSYNC_CHECK_ENUM(GS_INT64, gradsync::v1::INT64);
GRADSYNC_CHECK_ENUM(GS_UINT8, gradsync::v1::UINT8);
GRADSYNC_CHECK_ENUM(GS_INT8, gradsync::v1::INT8);
GRADSYNC_CHECK_ENUM(GS_INT8, gradsync::v1::DType_MAX);
GRADSYNC_CHECK_ENUM(GS_SUM, gradsync::v1::SUM);
GRADSYNC_CHECK_ENUM(GS_MEAN, gradsync::v1::MEAN);
GRADSYNC_CHECK_ENUM(GS_MIN, gradsync::v1::MIN);
GRADSYNC_CHECK_ENUM(GS_MAX, gradsync::v1::MAX);
GRADSYNC_CHECK_ENUM(GS_MAX, gradsync::v1::ReduceOp_MAX);
#undef GRADSYNC_CHECK_ENUM

struct gs_client {
  std::unique_ptr<gradsync::client::Client> impl;
  std::unique_ptr<gradsync::client::StoreClient> store;  // gs_connect_ex only
  std::string job;
};
struct gs_buffer {
  std::unique_ptr<gradsync::client::SharedBuffer> impl;
};
struct gs_cuda_buffer {
  std::unique_ptr<gradsync::client::CudaBuffer> impl;
};
struct gs_op {
  gradsync::client::Op impl;
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return static_cast<int>(status.code());
}

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  return Fail(status);
}

int Check(const void* p, const char* what) {
  if (p != nullptr) return 0;
  return Fail(absl::InvalidArgumentError(std::string(what) + " is NULL"));
}

std::vector<gradsync::client::Segment> Segments(const gs_segment* data, size_t n) {
  std::vector<gradsync::client::Segment> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back({data[i].buffer_id, data[i].byte_offset, data[i].count});
  }
  return out;
}

gradsync::client::OpOptions Options(const gs_op_options* o) {
  gradsync::client::OpOptions options;
  if (o == nullptr) return options;
  if (o->group != nullptr) options.group = o->group;
  if (o->name != nullptr) options.name = o->name;
  options.timeout = absl::Milliseconds(o->timeout_ms);
  return options;
}

gradsync::DType ToDType(int dtype) { return static_cast<gradsync::DType>(dtype); }
gradsync::v1::ReduceOp ToReduce(int op) { return static_cast<gradsync::v1::ReduceOp>(op); }

// Checks chain as `if (int rc = 0; (rc = A) || (rc = B)) return rc;`: the first failing one's
// code and message. Every call but the store's needs a session (gs_store_connect gives none).
int NeedSession(const gs_client* client) {
  if (int rc = Check(client, "client"); rc != 0) return rc;
  if (client->impl) return 0;
  return Fail(absl::FailedPreconditionError(
      "this client reaches the job's store only (gs_store_connect): it has no session"));
}

int NeedStore(const gs_client* client) {
  if (int rc = Check(client, "client"); rc != 0) return rc;
  if (client->store) return 0;
  return Fail(
      absl::FailedPreconditionError("this client has no store: connect with gs_connect_ex"));
}

absl::Time Within(int64_t timeout_ms) { return absl::Now() + absl::Milliseconds(timeout_ms); }

// A copy the caller releases with gs_free.
char* Duplicate(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p != nullptr) std::memcpy(p, s.data(), s.size() + 1);
  return p;
}

int ToJson(const google::protobuf::Message& message, char** out) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  if (auto s = google::protobuf::util::MessageToJsonString(message, &json, options); !s.ok()) {
    return Fail(absl::InternalError(std::string(s.message())));
  }
  *out = Duplicate(json);
  return *out == nullptr ? Fail(absl::ResourceExhaustedError("out of memory")) : 0;
}

int FromJson(const char* json, google::protobuf::Message* message) {
  if (int rc = Check(json, "json"); rc != 0) return rc;
  if (auto s = google::protobuf::util::JsonStringToMessage(json, message); !s.ok()) {
    return Fail(absl::InvalidArgumentError("bad " + message->GetTypeName() +
                                           " JSON: " + std::string(s.message())));
  }
  return 0;
}

int Emit(gradsync::client::Op op, gs_op** out) {
  *out = new gs_op{std::move(op)};
  return 0;
}

}  // namespace

extern "C" {

const char* gs_last_error(void) { return last_error.c_str(); }

int gs_connect(const char* target, const char* job, int world_size, int rank, int local_rank,
               int local_world_size, gs_client** out) {
  if (int rc = 0;
      (rc = Check(target, "target")) || (rc = Check(job, "job")) || (rc = Check(out, "out")))
    return rc;
  gradsync::client::Placement placement{job, world_size, rank, local_rank, local_world_size, ""};
  auto client = gradsync::client::Client::Connect(target, placement);
  if (!client.ok()) return Fail(client.status());
  *out = new gs_client{*std::move(client), nullptr, job};
  return 0;
}

namespace {

// The channel options `options` name (NULL: the defaults).
absl::StatusOr<gradsync::client::ClientOptions> ClientOptionsOf(const gs_connect_options* options) {
  gradsync::client::ClientOptions client_options;
  if (options == nullptr) return client_options;
  if (options->token != nullptr) client_options.token = options->token;
  if (options->rpc_timeout_ms > 0) {
    client_options.rpc_timeout = absl::Milliseconds(options->rpc_timeout_ms);
  }
  auto text = [](const char* s) { return std::string(s != nullptr ? s : ""); };
  auto tls = gradsync::ReadTlsFiles(
      {text(options->tls_cert_file), text(options->tls_key_file), text(options->tls_ca_file)});
  if (!tls.ok()) return tls.status();
  client_options.tls = *std::move(tls);
  return client_options;
}

std::string RootOf(const gs_connect_options* options) {
  return options != nullptr && options->root_address != nullptr ? options->root_address : "";
}

// Job `job`'s store: the root daemon's, else the daemon at `target`. A client given no token
// reaches a root daemon over TCP with the job's credential its own daemon (at `target`) hands
// out.
absl::StatusOr<std::unique_ptr<gradsync::client::StoreClient>> StoreOf(
    const char* target, const std::string& root, gradsync::client::ClientOptions client_options,
    const char* job) {
  if (!root.empty() && client_options.token.empty()) {
    gradsync::client::StoreClient local(gradsync::client::Connect(target, client_options),
                                        client_options);
    absl::StatusOr<std::string> credential = local.ClientCredential(job);
    if (!credential.ok()) {
      return absl::Status(
          credential.status().code(),
          absl::StrCat("the credential for the root daemon ", root, " from the daemon at ", target,
                       ": ", credential.status().message()));
    }
    client_options.token = *std::move(credential);
  }
  return std::make_unique<gradsync::client::StoreClient>(
      gradsync::client::Connect(root.empty() ? std::string(target) : root, client_options),
      client_options);
}

}  // namespace

int gs_connect_ex(const char* target, const char* job, int world_size, int rank, int local_rank,
                  int local_world_size, const gs_connect_options* options, gs_client** out) {
  if (int rc = 0;
      (rc = Check(target, "target")) || (rc = Check(job, "job")) || (rc = Check(out, "out")))
    return rc;
  const std::string root = RootOf(options);
  gradsync::client::Placement placement{job, world_size, rank, local_rank, local_world_size, root};
  if (options != nullptr) {
    placement.elastic = options->elastic != 0;
    placement.epoch = options->epoch;
  }
  auto client_options = ClientOptionsOf(options);
  if (!client_options.ok()) return Fail(client_options.status());
  auto client = gradsync::client::Client::Connect(target, placement, *client_options);
  if (!client.ok()) return Fail(client.status());
  auto store = StoreOf(target, root, *client_options, job);
  if (!store.ok()) return Fail(store.status());
  *out = new gs_client{*std::move(client), *std::move(store), job};
  return 0;
}

int gs_store_connect(const char* target, const char* job, const gs_connect_options* options,
                     gs_client** out) {
  if (int rc = 0;
      (rc = Check(target, "target")) || (rc = Check(job, "job")) || (rc = Check(out, "out")))
    return rc;
  if (absl::Status s = gradsync::CheckJobId(job); !s.ok()) return Fail(s);
  auto client_options = ClientOptionsOf(options);
  if (!client_options.ok()) return Fail(client_options.status());
  auto store = StoreOf(target, RootOf(options), *client_options, job);
  if (!store.ok()) return Fail(store.status());
  *out = new gs_client{nullptr, *std::move(store), job};
  return 0;
}

void gs_close(gs_client* client) { delete client; }

int64_t gs_default_op_timeout_ms(const gs_client* client) {
  return client && client->impl ? absl::ToInt64Milliseconds(client->impl->default_op_timeout()) : 0;
}

int gs_buffer_create(gs_client* client, int64_t bytes, int dtype, gs_buffer** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  auto buffer = client->impl->CreateBuffer(bytes, ToDType(dtype));
  if (!buffer.ok()) return Fail(buffer.status());
  *out = new gs_buffer{*std::move(buffer)};
  return 0;
}

void* gs_buffer_data(const gs_buffer* buffer) { return buffer ? buffer->impl->data() : nullptr; }
uint64_t gs_buffer_id(const gs_buffer* buffer) { return buffer ? buffer->impl->id() : 0; }
int64_t gs_buffer_size(const gs_buffer* buffer) { return buffer ? buffer->impl->size() : 0; }

int gs_buffer_destroy(gs_client* client, gs_buffer* buffer) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(buffer, "buffer"))) return rc;
  const int rc = Report(client->impl->DestroyBuffer(std::move(buffer->impl)));
  delete buffer;
  return rc;
}

int gs_buffer_deregister(gs_client* client, const gs_buffer* buffer) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(buffer, "buffer"))) return rc;
  if (!buffer->impl) return Fail(absl::InvalidArgumentError("buffer was destroyed"));
  return Report(client->impl->DeregisterBuffer(buffer->impl->id()));
}

void gs_buffer_free(gs_buffer* buffer) { delete buffer; }

int gs_buffer_register_fd(gs_client* client, int fd, int64_t bytes, int dtype, uint64_t* id) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(id, "id"))) return rc;
  auto token = client->impl->ShareFd(fd);
  if (!token.ok()) return Fail(token.status());
  gradsync::v1::RegisterBufferRequest request;
  request.set_bytes(bytes);
  request.set_dtype(ToDType(dtype));
  request.set_fd_token(*token);
  auto registered = client->impl->RegisterBuffer(request);
  if (!registered.ok()) return Fail(registered.status());
  *id = *registered;
  return 0;
}

int gs_buffer_deregister_id(gs_client* client, uint64_t id) {
  if (int rc = NeedSession(client); rc != 0) return rc;
  return Report(client->impl->DeregisterBuffer(id));
}

int gs_cuda_allocation_of(const void* ptr, gs_cuda_allocation* out) {
  if (int rc = Check(out, "out"); rc != 0) return rc;
  auto a = gradsync::client::CudaAllocationOf(ptr);
  if (!a.ok()) return Fail(a.status());
  *out = {a->id, a->base, a->bytes, a->device, a->ipc_capable ? 1 : 0};
  return 0;
}

int gs_cuda_buffer_register(gs_client* client, void* device_ptr, int64_t bytes, int dtype,
                            gs_cuda_buffer** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  auto buffer = client->impl->RegisterCudaBuffer(device_ptr, bytes, ToDType(dtype));
  if (!buffer.ok()) return Fail(buffer.status());
  *out = new gs_cuda_buffer{*std::move(buffer)};
  return 0;
}

uint64_t gs_cuda_buffer_id(const gs_cuda_buffer* buffer) { return buffer ? buffer->impl->id() : 0; }

int gs_cuda_buffer_ready(gs_cuda_buffer* buffer, void* stream) {
  if (int rc = Check(buffer, "buffer"); rc != 0) return rc;
  return Report(buffer->impl->Ready(stream));
}

int gs_cuda_buffer_wait_done(gs_cuda_buffer* buffer, void* stream) {
  if (int rc = Check(buffer, "buffer"); rc != 0) return rc;
  return Report(buffer->impl->WaitDone(stream));
}

int gs_cuda_buffer_deregister(gs_client* client, const gs_cuda_buffer* buffer) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(buffer, "buffer"))) return rc;
  return Report(client->impl->DeregisterBuffer(buffer->impl->id()));
}

void gs_cuda_buffer_free(gs_cuda_buffer* buffer) { delete buffer; }

int gs_settle(gs_client* client) {
  if (int rc = NeedSession(client)) return rc;
  return Report(client->impl->Settle());
}

int gs_all_reduce_async(gs_client* client, int dtype, int reduce_op, const gs_segment* data,
                        size_t n, const gs_op_options* options, gs_op** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  if (n > 0 && data == nullptr) return Check(data, "data");
  return Emit(client->impl->AllReduceAsync(ToDType(dtype), ToReduce(reduce_op), Segments(data, n),
                                           Options(options)),
              out);
}

int gs_broadcast_async(gs_client* client, int dtype, int root, const gs_segment* data, size_t n,
                       const gs_op_options* options, gs_op** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  if (n > 0 && data == nullptr) return Check(data, "data");
  return Emit(
      client->impl->BroadcastAsync(ToDType(dtype), root, Segments(data, n), Options(options)), out);
}

int gs_barrier_async(gs_client* client, const gs_op_options* options, gs_op** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  return Emit(client->impl->BarrierAsync(Options(options)), out);
}

int gs_all_gather_async(gs_client* client, int dtype, const gs_segment* input, size_t n_input,
                        const gs_segment* output, size_t n_output, const gs_op_options* options,
                        gs_op** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  if ((n_input > 0 && input == nullptr) || (n_output > 0 && output == nullptr)) {
    return Check(nullptr, "segments");
  }
  return Emit(client->impl->AllGatherAsync(ToDType(dtype), Segments(input, n_input),
                                           Segments(output, n_output), Options(options)),
              out);
}

int gs_reduce_scatter_async(gs_client* client, int dtype, int reduce_op, const gs_segment* input,
                            size_t n_input, const gs_segment* output, size_t n_output,
                            const gs_op_options* options, gs_op** out) {
  if (int rc = 0; (rc = NeedSession(client)) || (rc = Check(out, "out"))) return rc;
  if ((n_input > 0 && input == nullptr) || (n_output > 0 && output == nullptr)) {
    return Check(nullptr, "segments");
  }
  return Emit(client->impl->ReduceScatterAsync(ToDType(dtype), ToReduce(reduce_op),
                                               Segments(input, n_input), Segments(output, n_output),
                                               Options(options)),
              out);
}

int gs_op_wait(gs_op* op) {
  if (int rc = Check(op, "op"); rc != 0) return rc;
  return Report(op->impl.Wait());
}

int gs_op_wait_for(gs_op* op, int64_t timeout_ms, int* done) {
  if (int rc = 0; (rc = Check(op, "op")) || (rc = Check(done, "done"))) return rc;
  absl::Status status;
  *done = op->impl.WaitFor(absl::Milliseconds(timeout_ms), &status) ? 1 : 0;
  return *done ? Report(status) : 0;
}

uint64_t gs_op_seq(gs_op* op) { return op ? op->impl.seq() : 0; }

int gs_op_test(gs_op* op, int* done) {
  if (int rc = 0; (rc = Check(op, "op")) || (rc = Check(done, "done"))) return rc;
  *done = op->impl.Done() ? 1 : 0;
  return 0;
}

void gs_op_free(gs_op* op) { delete op; }

int gs_all_reduce(gs_client* client, int dtype, int reduce_op, const gs_segment* data, size_t n,
                  const gs_op_options* options) {
  gs_op* op = nullptr;
  if (int rc = gs_all_reduce_async(client, dtype, reduce_op, data, n, options, &op); rc != 0) {
    return rc;
  }
  const int rc = gs_op_wait(op);
  gs_op_free(op);
  return rc;
}

int gs_store_set(gs_client* client, const char* key, const void* value, size_t n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(key, "key"))) return rc;
  if (n > 0 && value == nullptr) return Check(value, "value");
  return Report(
      client->store->Set(client->job, key, std::string(static_cast<const char*>(value), n)));
}

int gs_store_add(gs_client* client, const char* key, int64_t delta, int64_t* out) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(key, "key")) || (rc = Check(out, "out")))
    return rc;
  auto v = client->store->Add(client->job, key, delta);
  if (!v.ok()) return Fail(v.status());
  *out = *v;
  return 0;
}

int gs_store_get(gs_client* client, const char* key, int64_t timeout_ms, void** value, size_t* n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(key, "key")) ||
                  (rc = Check(value, "value")) || (rc = Check(n, "n"))) {
    return rc;
  }
  auto v = client->store->WaitBlocking(client->job, {key}, Within(timeout_ms));
  if (!v.ok()) return Fail(v.status());
  const std::string& s = v->at(0);
  *value = std::malloc(s.empty() ? 1 : s.size());
  if (*value == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  std::memcpy(*value, s.data(), s.size());
  *n = s.size();
  return 0;
}

int gs_store_compare_set(gs_client* client, const char* key, const void* expected,
                         size_t expected_n, const void* desired, size_t desired_n, int* swapped,
                         void** value, size_t* n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(key, "key")) ||
                  (rc = Check(swapped, "swapped")) || (rc = Check(value, "value")) ||
                  (rc = Check(n, "n"))) {
    return rc;
  }
  if (desired_n > 0 && desired == nullptr) return Check(desired, "desired");
  std::optional<std::string> want;
  if (expected != nullptr) want.emplace(static_cast<const char*>(expected), expected_n);
  auto v = client->store->CompareSet(
      client->job, key, want,
      desired_n > 0 ? std::string(static_cast<const char*>(desired), desired_n) : std::string());
  if (!v.ok()) return Fail(v.status());
  *value = std::malloc(v->value.empty() ? 1 : v->value.size());
  if (*value == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  std::memcpy(*value, v->value.data(), v->value.size());
  *n = v->value.size();
  *swapped = v->swapped ? 1 : 0;
  return 0;
}

namespace {

// *value (malloc'd, released with gs_free) and *n: a copy of `bytes`.
int CopyOut(const std::string& bytes, void** value, size_t* n) {
  *value = std::malloc(bytes.empty() ? 1 : bytes.size());
  if (*value == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  std::memcpy(*value, bytes.data(), bytes.size());
  *n = bytes.size();
  return 0;
}

}  // namespace

int gs_store_join(gs_client* client, int ranks, int64_t timeout_ms, int64_t* ticket,
                  void** admission, size_t* n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(ticket, "ticket")) ||
                  (rc = Check(admission, "admission")) || (rc = Check(n, "n"))) {
    return rc;
  }
  auto v =
      client->store->Join(client->job, ranks, absl::Milliseconds(timeout_ms), gradsync::kJoinGrace);
  if (!v.ok()) return Fail(v.status());
  *ticket = v->ticket();
  return CopyOut(v->admission(), admission, n);
}

int gs_store_take_ticket(gs_client* client, int ranks, int64_t* ticket) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(ticket, "ticket"))) return rc;
  auto v = client->store->TakeTicket(client->job, ranks);
  if (!v.ok()) return Fail(v.status());
  *ticket = *v;
  return 0;
}

int gs_store_withdraw_ticket(gs_client* client, int64_t ticket, int* withdrawn, void** state,
                             size_t* n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(withdrawn, "withdrawn")) ||
                  (rc = Check(state, "state")) || (rc = Check(n, "n"))) {
    return rc;
  }
  auto v = client->store->WithdrawTicket(client->job, ticket);
  if (!v.ok()) return Fail(v.status());
  *withdrawn = v->withdrawn() ? 1 : 0;
  return CopyOut(v->state(), state, n);
}

int gs_store_admit_joiners(gs_client* client, int epoch, int min_world_size, int min_joined,
                           int* decided, void** decision, size_t* n) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(decided, "decided")) ||
                  (rc = Check(decision, "decision")) || (rc = Check(n, "n"))) {
    return rc;
  }
  auto v = client->store->AdmitJoiners(client->job, epoch, min_world_size, min_joined);
  if (!v.ok()) return Fail(v.status());
  *decided = v->decided() ? 1 : 0;
  return CopyOut(v->decision(), decision, n);
}

void gs_free(void* p) { std::free(p); }

int gs_set_pack_list(gs_client* client, const char* group, const char* plan_json) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(group, "group"))) return rc;
  gradsync::v1::PackList plan;
  if (int rc = FromJson(plan_json, &plan); rc != 0) return rc;
  return Report(client->store->SetPackList(client->job, group, plan));
}

int gs_get_pack_list(gs_client* client, const char* group, int64_t timeout_ms, char** plan_json) {
  if (int rc = 0; (rc = NeedStore(client)) || (rc = Check(group, "group")) ||
                  (rc = Check(plan_json, "plan_json"))) {
    return rc;
  }
  auto plan = client->store->GetPackList(client->job, group, Within(timeout_ms));
  if (!plan.ok()) return Fail(plan.status());
  return ToJson(*plan, plan_json);
}

int gs_plan_packs(const char* grads_json, int64_t threshold_bytes, int32_t first_alone,
                  char** plan_json) {
  if (int rc = Check(plan_json, "plan_json"); rc != 0) return rc;
  gradsync::v1::Pack grads;
  if (int rc = FromJson(grads_json, &grads); rc != 0) return rc;
  if (grads.indices_size() != grads.shapes_size()) {
    return Fail(absl::InvalidArgumentError("grads: indices and shapes differ in length"));
  }
  std::vector<gradsync::GradInfo> infos(grads.indices_size());
  for (int i = 0; i < grads.indices_size(); ++i) {
    infos[i].index = grads.indices(i);
    infos[i].spec = grads.shapes(i);
  }
  gradsync::PackOptions options;
  options.threshold_bytes = threshold_bytes;
  options.first_alone = first_alone;
  auto plan = gradsync::PlanPacks(infos, options);
  if (!plan.ok()) return Fail(plan.status());
  return ToJson(*plan, plan_json);
}

int gs_record_json(const char* kind, const void* record, size_t n, char** json) {
  if (int rc = 0; (rc = Check(kind, "kind")) || (rc = Check(json, "json")) ||
                  (rc = n > 0 ? Check(record, "record") : 0)) {
    return rc;
  }
  absl::StatusOr<std::string> text =
      gradsync::ElasticRecordJson(kind, absl::string_view(static_cast<const char*>(record), n));
  if (!text.ok()) return Fail(text.status());
  *json = Duplicate(*text);
  return *json == nullptr ? Fail(absl::ResourceExhaustedError("out of memory")) : 0;
}

int64_t gs_dtype_size(int dtype) { return gradsync::DTypeSize(ToDType(dtype)); }

}  // extern "C"
