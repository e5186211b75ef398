/* A trainer written in C against client/gradsync.h: all-reduce (sync), broadcast (async),
 * one error, and (rank 0) a client of the job's store alone. Exit 0 when every check passes.
 *   c_api_worker <target> <job> <world_size> <rank> */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/gradsync.h"

#define CHECK(cond, ...)                           \
  do {                                             \
    if (!(cond)) {                                 \
      fprintf(stderr, "CHECK FAILED %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);                \
      fprintf(stderr, "\n");                       \
      return 1;                                    \
    }                                              \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const int world = atoi(argv[3]), rank = atoi(argv[4]);
  gs_client* client = NULL;
  int rc = gs_connect(argv[1], argv[2], world, rank, rank, world, &client);
  CHECK(rc == 0, "connect rc=%d %s", rc, gs_last_error());
  gs_buffer* buffer = NULL;
  rc = gs_buffer_create(client, 1000 * sizeof(double), GS_FLOAT64, &buffer);
  CHECK(rc == 0, "buffer rc=%d %s", rc, gs_last_error());
  double* x = (double*)gs_buffer_data(buffer);
  for (int i = 0; i < 1000; ++i) x[i] = (rank + 1) * i;
  gs_segment whole = {gs_buffer_id(buffer), 0, 1000};
  rc = gs_all_reduce(client, GS_FLOAT64, GS_SUM, &whole, 1, NULL);
  CHECK(rc == 0, "all_reduce rc=%d %s", rc, gs_last_error());
  const double factor = world * (world + 1) / 2.0;
  for (int i = 0; i < 1000; ++i) CHECK(x[i] == factor * i, "x[%d]=%g", i, x[i]);

  x[0] = 100 + rank;
  gs_segment first = {gs_buffer_id(buffer), 0, 1};
  gs_op_options options = {"world", "bcast", 5000};
  gs_op* op = NULL;
  rc = gs_broadcast_async(client, GS_FLOAT64, 0, &first, 1, &options, &op);
  CHECK(rc == 0, "broadcast submit rc=%d", rc);
  rc = gs_op_wait(op);
  gs_op_free(op);
  CHECK(rc == 0, "broadcast rc=%d %s", rc, gs_last_error());
  CHECK(x[0] == 100, "broadcast x[0]=%g", x[0]);

  gs_segment unknown = {4242, 0, 1};
  rc = gs_all_reduce(client, GS_FLOAT64, GS_SUM, &unknown, 1, NULL);
  CHECK(rc == 5 && strstr(gs_last_error(), "4242") != NULL, "unknown buffer rc=%d %s", rc,
        gs_last_error());

  if (rank == 0) {
    /* A client of the job's store alone: the same keys as the session's, no ops. */
    gs_client* store = NULL;
    rc = gs_store_connect(argv[1], argv[2], NULL, &store);
    CHECK(rc == 0, "store connect rc=%d %s", rc, gs_last_error());
    int swapped = 0;
    void* value = NULL;
    size_t n = 0;
    rc = gs_store_compare_set(store, "cas", NULL, 0, "one", 3, &swapped, &value, &n);
    CHECK(rc == 0 && swapped == 1 && n == 3 && memcmp(value, "one", 3) == 0, "cas rc=%d %s", rc,
          gs_last_error());
    gs_free(value);
    rc = gs_store_compare_set(store, "cas", "two", 3, "three", 5, &swapped, &value, &n);
    CHECK(rc == 0 && swapped == 0 && n == 3 && memcmp(value, "one", 3) == 0,
          "cas (wrong expected) rc=%d %s", rc, gs_last_error());
    gs_free(value);
    rc = gs_store_compare_set(store, "cas", "one", 3, "", 0, &swapped, &value, &n);
    CHECK(rc == 0 && swapped == 1 && n == 0, "cas to empty rc=%d %s", rc, gs_last_error());
    gs_free(value);
    rc = gs_store_get(store, "cas", 1000, &value, &n);
    CHECK(rc == 0 && n == 0, "get rc=%d %s", rc, gs_last_error());
    gs_free(value);
    rc = gs_all_reduce(store, GS_FLOAT64, GS_SUM, &whole, 1, NULL);
    CHECK(rc == 9 && strstr(gs_last_error(), "no session") != NULL, "store op rc=%d %s", rc,
          gs_last_error());
    CHECK(gs_default_op_timeout_ms(store) == 0, "store-only default timeout");
    /* Two bad arguments: the first one's code and message, never a sum of codes. */
    rc = gs_buffer_create(store, 8, GS_FLOAT64, NULL);
    CHECK(rc == 9 && strstr(gs_last_error(), "no session") != NULL, "two errors rc=%d %s", rc,
          gs_last_error());
    gs_client* bad = NULL;
    rc = gs_store_connect(argv[1], "../bad", NULL, &bad);
    CHECK(rc == 3 && bad == NULL, "bad job rc=%d %s", rc, gs_last_error());
    gs_close(store);
  }

  rc = gs_buffer_destroy(client, buffer);
  CHECK(rc == 0, "destroy rc=%d %s", rc, gs_last_error());
  gs_close(client);
  printf("c api ok\n");
  return 0;
}
