// The C ABI of client/gradsync.h over the C++ client. No exception or C++ type crosses it.
#include <memory>
#include <string>
#include <vector>

#include "client/gradsync.h"
#include "client/gradsync_client.h"

struct gs_client {
  std::unique_ptr<gradsync::client::Client> impl;
};
struct gs_buffer {
  std::unique_ptr<gradsync::client::SharedBuffer> impl;
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

int Emit(gradsync::client::Op op, gs_op** out) {
  *out = new gs_op{std::move(op)};
  return 0;
}

}  // namespace

extern "C" {

const char* gs_last_error(void) { return last_error.c_str(); }

int gs_connect(const char* target, const char* job, int world_size, int rank, int local_rank,
               int local_world_size, gs_client** out) {
  if (int rc = Check(target, "target") + Check(job, "job") + Check(out, "out"); rc != 0) return rc;
  gradsync::client::Placement placement{job, world_size, rank, local_rank, local_world_size, ""};
  auto client = gradsync::client::Client::Connect(target, placement);
  if (!client.ok()) return Fail(client.status());
  *out = new gs_client{*std::move(client)};
  return 0;
}

void gs_close(gs_client* client) { delete client; }

int gs_buffer_create(gs_client* client, int64_t bytes, int dtype, gs_buffer** out) {
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
  auto buffer = client->impl->CreateBuffer(bytes, ToDType(dtype));
  if (!buffer.ok()) return Fail(buffer.status());
  *out = new gs_buffer{*std::move(buffer)};
  return 0;
}

void* gs_buffer_data(const gs_buffer* buffer) { return buffer ? buffer->impl->data() : nullptr; }
uint64_t gs_buffer_id(const gs_buffer* buffer) { return buffer ? buffer->impl->id() : 0; }
int64_t gs_buffer_size(const gs_buffer* buffer) { return buffer ? buffer->impl->size() : 0; }

int gs_buffer_destroy(gs_client* client, gs_buffer* buffer) {
  if (int rc = Check(client, "client") + Check(buffer, "buffer"); rc != 0) return rc;
  const int rc = Report(client->impl->DestroyBuffer(std::move(buffer->impl)));
  delete buffer;
  return rc;
}

int gs_all_reduce_async(gs_client* client, int dtype, int reduce_op, const gs_segment* data,
                        size_t n, const gs_op_options* options, gs_op** out) {
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
  if (n > 0 && data == nullptr) return Check(data, "data");
  return Emit(client->impl->AllReduceAsync(ToDType(dtype), ToReduce(reduce_op), Segments(data, n),
                                           Options(options)),
              out);
}

int gs_broadcast_async(gs_client* client, int dtype, int root, const gs_segment* data, size_t n,
                       const gs_op_options* options, gs_op** out) {
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
  if (n > 0 && data == nullptr) return Check(data, "data");
  return Emit(
      client->impl->BroadcastAsync(ToDType(dtype), root, Segments(data, n), Options(options)), out);
}

int gs_barrier_async(gs_client* client, const gs_op_options* options, gs_op** out) {
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
  return Emit(client->impl->BarrierAsync(Options(options)), out);
}

int gs_all_gather_async(gs_client* client, int dtype, const gs_segment* input, size_t n_input,
                        const gs_segment* output, size_t n_output, const gs_op_options* options,
                        gs_op** out) {
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
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
  if (int rc = Check(client, "client") + Check(out, "out"); rc != 0) return rc;
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

int gs_op_test(gs_op* op, int* done) {
  if (int rc = Check(op, "op") + Check(done, "done"); rc != 0) return rc;
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

}  // extern "C"
