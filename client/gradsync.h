/* gradsync C ABI: a trainer's session with its node's gradsyncd, for languages other than C++.
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
void gs_close(gs_client* client);

/* Shared memory of `bytes`, registered with the daemon; dtype 0: any. */
int gs_buffer_create(gs_client* client, int64_t bytes, int dtype, gs_buffer** out);
void* gs_buffer_data(const gs_buffer* buffer);
uint64_t gs_buffer_id(const gs_buffer* buffer);
int64_t gs_buffer_size(const gs_buffer* buffer);
/* Deregisters and unmaps; the buffer is freed even when deregistration fails. */
int gs_buffer_destroy(gs_client* client, gs_buffer* buffer);

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
/* *done = 1 once complete (never blocks). */
int gs_op_test(gs_op* op, int* done);
void gs_op_free(gs_op* op);

/* Synchronous all-reduce: submit and wait. */
int gs_all_reduce(gs_client* client, int dtype, int reduce_op, const gs_segment* data, size_t n,
                  const gs_op_options* options);

#ifdef __cplusplus
}
#endif

#endif /* GRADSYNC_H_ */
