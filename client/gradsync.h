/* gradsync C ABI: a trainer's session with its node's gradsyncd, for languages other than C++.
 * It is the one boundary every other language uses: the Python package loads this library
 * (libgradsync_c.so) with ctypes, so one build serves every CPython.
 *
 * Every function returning int returns a gRPC status code (0 = OK; 3 INVALID_ARGUMENT,
 * 4 DEADLINE_EXCEEDED, 5 NOT_FOUND, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, ...); the message
 * of the calling thread's last failure is gs_last_error(). Objects are opaque; a client must
 * outlive its buffers and ops. Thread-safe like the C++ client (client/gradsync_client.h). */
#ifndef GRADSYNC_H_
#define GRADSYNC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gs_client gs_client;
typedef struct gs_buffer gs_buffer;
typedef struct gs_op gs_op;

/* Values of gradsync.v1.DType / ReduceOp on the wire. */
enum gs_dtype {
  GS_FLOAT32 = 1,
  GS_FLOAT64 = 2,
  GS_FLOAT16 = 3,
  GS_BFLOAT16 = 4,
  GS_INT32 = 5,
  GS_INT64 = 6,
  GS_UINT8 = 7,
  GS_INT8 = 8
};
enum gs_reduce_op { GS_SUM = 1, GS_MEAN = 2, GS_MIN = 3, GS_MAX = 4 };

typedef struct gs_segment {
  uint64_t buffer_id;
  int64_t byte_offset;
  int64_t count;
} gs_segment;

/* Options of one op; NULL means the defaults (WORLD, no name, the daemon's deadline). */
typedef struct gs_op_options {
  const char* group;  /* "world" or "0,2,3"; NULL: world */
  const char* name;   /* NULL: none */
  int64_t timeout_ms; /* 0: the daemon's default */
} gs_op_options;

const char* gs_last_error(void);

int gs_connect(const char* target, const char* job, int world_size, int rank, int local_rank,
               int local_world_size, gs_client** out);

/* Options of gs_connect_ex; NULL means the defaults. */
typedef struct gs_connect_options {
  const char*
      root_address;  /* the job's root daemon (host:port) when it spans nodes; NULL: this one */
  const char* token; /* the cluster token, for a root daemon over TCP; NULL: none */
  int64_t rpc_timeout_ms; /* deadline of calls that do not wait; 0: 10 s */
  /* Mutual TLS to a root daemon started with --tls_*: PEM files (all three or none; the key
   * readable by no "other"); NULL: plaintext. */
  const char* tls_cert_file;
  const char* tls_key_file;
  const char* tls_ca_file;
  /* Non-zero: an elastic job, at membership `epoch` (0 first; E > 0: the job id ends ".e<E>").
   * When a node is lost its daemons record the new membership in the job's store under
   * "_gradsync_elastic/decision"; the survivors register again at the next epoch. */
  int32_t elastic;
  int32_t epoch;
} gs_connect_options;

/* gs_connect, and a connection to the job's store (the root daemon's, else this daemon's). */
int gs_connect_ex(const char* target, const char* job, int world_size, int rank, int local_rank,
                  int local_world_size, const gs_connect_options* options, gs_client** out);
/* A client of job `job`'s store only, without a session (no rank, no ops): the gs_store_*
 * calls and gs_close; every other call fails FAILED_PRECONDITION. The store is the root
 * daemon's (options->root_address) else the daemon's at `target`; the channel options are
 * gs_connect_ex's (elastic and epoch unused). Used by elastic jobs to reach the job's own
 * keys across membership epochs. */
int gs_store_connect(const char* target, const char* job, const gs_connect_options* options,
                     gs_client** out);
/* Ends the session: the daemon fails this rank's pending ops in its groups. Every op and call
 * on the client must have returned; buffers stay mapped until gs_buffer_free. */
void gs_close(gs_client* client);
/* The daemon's deadline for ops that name none. */
int64_t gs_default_op_timeout_ms(const gs_client* client);

/* Shared memory of `bytes`, registered with the daemon; dtype 0: any. */
int gs_buffer_create(gs_client* client, int64_t bytes, int dtype, gs_buffer** out);
void* gs_buffer_data(const gs_buffer* buffer);
uint64_t gs_buffer_id(const gs_buffer* buffer);
int64_t gs_buffer_size(const gs_buffer* buffer);
/* Deregisters and unmaps; the buffer is freed even when deregistration fails. */
int gs_buffer_destroy(gs_client* client, gs_buffer* buffer);
/* Deregisters from the daemon but keeps the mapping (views of it stay valid). */
int gs_buffer_deregister(gs_client* client, const gs_buffer* buffer);
/* Unmaps and frees (after gs_buffer_deregister, or after gs_close); never calls the daemon. */
void gs_buffer_free(gs_buffer* buffer);

/* Memory the caller manages: `fd` is a memfd sealed with F_SEAL_SHRINK (the caller keeps its
 * own copy, and its mapping) handed to the daemon, which maps `bytes` of it; *id names it in
 * ops. Unix-socket sessions only. */
int gs_buffer_register_fd(gs_client* client, int fd, int64_t bytes, int dtype, uint64_t* id);
/* Deregisters any buffer by id (ops already submitted keep it until they finish). */
int gs_buffer_deregister_id(gs_client* client, uint64_t id);

/* ---- CUDA device memory (GPU nodes) ----
 * Registered the way PyTorch shares caching-allocator blocks: the IPC handle of the allocation
 * the memory lies in, its offset there, and two interprocess events per registration. The
 * daemon's stream waits for "ready" (recorded by gs_cuda_buffer_ready on the caller's stream)
 * before it reads the buffer; it records "done" after it wrote it, before the op completes;
 * gs_cuda_buffer_wait_done makes the caller's stream wait for that. Nothing here synchronises
 * the host with the device. Built without CUDA: FAILED_PRECONDITION.
 * An event stands for its latest record, so a registration serves one group's ops at a time
 * (they run in order on one daemon stream): the daemon refuses (FAILED_PRECONDITION) an op
 * naming a registration that a not yet completed op of another group names, and
 * gs_cuda_buffer_wait_done waits for the registration's latest op. For ops of other groups
 * that may overlap on the same memory, register it once per such op: the daemon maps the
 * allocation once. */
typedef struct gs_cuda_buffer gs_cuda_buffer;

/* The allocation a device pointer lies in (two driver queries, no daemon call). id is unique
 * among the process's allocations for its whole life (a freed allocation's id never returns):
 * key registrations on it. id 0: not CUDA memory, or freed. */
typedef struct gs_cuda_allocation {
  uint64_t id;
  uint64_t base;
  int64_t bytes;
  int32_t device;
  int32_t ipc_capable; /* 0: cudaIpcGetMemHandle cannot export it (cuMemCreate memory, e.g.
                          PyTorch's expandable segments) */
} gs_cuda_allocation;
int gs_cuda_allocation_of(const void* ptr, gs_cuda_allocation* out);

/* Registers `bytes` of device memory at `device_ptr` (which must stay allocated while
 * registered); dtype 0: any. Ops name it by gs_cuda_buffer_id. */
int gs_cuda_buffer_register(gs_client* client, void* device_ptr, int64_t bytes, int dtype,
                            gs_cuda_buffer** out);
uint64_t gs_cuda_buffer_id(const gs_cuda_buffer* buffer);
/* Records "ready" on `stream` (a cudaStream_t; NULL: the legacy default stream): the daemon's
 * next op on the buffer starts after the stream's work so far. Call before submitting. */
int gs_cuda_buffer_ready(gs_cuda_buffer* buffer, void* stream);
/* `stream`'s later work waits for the daemon's last write of the buffer ("done"). Call once the
 * op that wrote it completed (gs_op_wait), before the stream reads the result. */
int gs_cuda_buffer_wait_done(gs_cuda_buffer* buffer, void* stream);
/* Deregisters from the daemon. Returns once the daemon has closed its handles of the events:
 * every op that named the buffer has settled on the device (a launched op may still record
 * "done"). Only then may gs_cuda_buffer_free destroy them; after a failure, keep them (never
 * free the buffer) to the process's end. */
int gs_cuda_buffer_deregister(gs_client* client, const gs_cuda_buffer* buffer);
/* Waits until every device op this session submitted has settled on the device: 0, or the
 * error of one answered OK that failed on the device afterwards (ABORTED: its results are not
 * valid), reported once. Call before saving state that such ops wrote (a checkpoint). Bounded by
 * the session's default op timeout. */
int gs_settle(gs_client* client);
/* Destroys the events (after gs_cuda_buffer_deregister and the completion of the buffer's ops,
 * or after gs_close); no daemon call. */
void gs_cuda_buffer_free(gs_cuda_buffer* buffer);

/* Asynchronous ops: *out receives the op to wait on and free. */
int gs_all_reduce_async(gs_client* client, int dtype, int reduce_op, const gs_segment* data,
                        size_t n, const gs_op_options* options, gs_op** out);
int gs_broadcast_async(gs_client* client, int dtype, int root, const gs_segment* data, size_t n,
                       const gs_op_options* options, gs_op** out);
int gs_barrier_async(gs_client* client, const gs_op_options* options, gs_op** out);
int gs_all_gather_async(gs_client* client, int dtype, const gs_segment* input, size_t n_input,
                        const gs_segment* output, size_t n_output, const gs_op_options* options,
                        gs_op** out);
int gs_reduce_scatter_async(gs_client* client, int dtype, int reduce_op, const gs_segment* input,
                            size_t n_input, const gs_segment* output, size_t n_output,
                            const gs_op_options* options, gs_op** out);

/* Blocks until the op completes; returns its status. */
int gs_op_wait(gs_op* op);
/* Waits at most timeout_ms: *done = 0 (returns 0) while the op is pending; *done = 1 and the
 * op's status once it completed or its deadline passed. For callers that must wake up
 * regularly (signal handling). */
int gs_op_wait_for(gs_op* op, int64_t timeout_ms, int* done);
/* *done = 1 once complete (never blocks). */
int gs_op_test(gs_op* op, int* done);
/* This rank's sequence number of the op on its group (once complete). */
uint64_t gs_op_seq(gs_op* op);
/* An op may be freed before it completes (its outcome is dropped), also after gs_close. */
void gs_op_free(gs_op* op);

/* The job's store (keys of the client's job). A value is bytes; gs_free releases what a call
 * returns through a pointer. */
int gs_store_set(gs_client* client, const char* key, const void* value, size_t n);
int gs_store_add(gs_client* client, const char* key, int64_t delta, int64_t* out);
/* Waits until `key` exists, at most timeout_ms (then DEADLINE_EXCEEDED naming it). */
int gs_store_get(gs_client* client, const char* key, int64_t timeout_ms, void** value, size_t* n);
/* Sets `key` to `desired` if its value is `expected` (NULL: if it has none). *swapped: 1 if
 * it did; *value (released with gs_free) and *n: the key's value after the call. */
int gs_store_compare_set(gs_client* client, const char* key, const void* expected,
                         size_t expected_n, const void* desired, size_t desired_n, int* swapped,
                         void** value, size_t* n);
/* Elastic jobs' joins; the daemon checks each request and writes every record itself.
 * gs_store_join: a joining node (its local rank 0, for its `ranks` ranks) asks to join the job
 * whose home is the client's job (epoch 0's id) and waits at most timeout_ms to be admitted at
 * the job's next commit; the daemon takes the node's ticket and withdraws it when the wait ends
 * unadmitted (DEADLINE_EXCEEDED) or the caller goes away. *admission (gs_free) and *n: the
 * node's gradsync.v1.JoinAdmission record (gs_record_json reads it), *ticket its ticket.
 * The steps, for tools: a joining node takes a ticket in the job's home (the client's job: epoch
 * 0's id) for its `ranks` ranks; its admission appears at "_gradsync_elastic/admit/<ticket>". It
 * may withdraw it: *withdrawn 1 if this call did, else *state (gs_free) says why ("claimed": an
 * admission is under way). Rank 0 admits the waiting tickets at a commit (the client's job: the
 * current epoch's id; `epoch` the next), none unless they bring `min_joined` ranks: *decided 1 when
 * the epoch has a decision now, *decision (gs_free) the record. */
int gs_store_join(gs_client* client, int ranks, int64_t timeout_ms, int64_t* ticket,
                  void** admission, size_t* n);
int gs_store_take_ticket(gs_client* client, int ranks, int64_t* ticket);
int gs_store_withdraw_ticket(gs_client* client, int64_t ticket, int* withdrawn, void** state,
                             size_t* n);
int gs_store_admit_joiners(gs_client* client, int epoch, int min_world_size, int min_joined,
                           int* decided, void** decision, size_t* n);
void gs_free(void* p);

/* Pack plans, as the JSON of gradsync.v1.PackList (proto field names, enums by name). */
int gs_set_pack_list(gs_client* client, const char* group, const char* plan_json);
/* Waits for the group's plan at most timeout_ms (DEADLINE_EXCEEDED naming it). */
int gs_get_pack_list(gs_client* client, const char* group, int64_t timeout_ms, char** plan_json);
/* The pack planner: grads_json is the JSON of a gradsync.v1.Pack whose indices and shapes list
 * the gradients in the order backward produced them (dtype in each shape). */
int gs_plan_packs(const char* grads_json, int64_t threshold_bytes, int32_t first_alone,
                  char** plan_json);
/* A record of an elastic job's store that only daemons write, as JSON (proto field names,
 * every field, enums by name): kind "decision" (gradsync.v1.MembershipDecision, at
 * _gradsync_elastic/decision), "ticket" (gradsync.v1.JoinTicket, at _gradsync_elastic/ticket/<T>)
 * or "admission" (gradsync.v1.JoinAdmission, at _gradsync_elastic/admit/<T>); *json (gs_free).
 * INVALID_ARGUMENT when the bytes are not such a record. */
int gs_record_json(const char* kind, const void* record, size_t n, char** json);
/* Bytes per element of a gs_dtype; 0 if unknown. */
int64_t gs_dtype_size(int dtype);

/* Synchronous all-reduce: submit and wait. */
int gs_all_reduce(gs_client* client, int dtype, int reduce_op, const gs_segment* data, size_t n,
                  const gs_op_options* options);

#ifdef __cplusplus
}
#endif

#endif /* GRADSYNC_H_ */
