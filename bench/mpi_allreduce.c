// mpi_allreduce: Open MPI peer for bench/collective_bench.py.
//
// Measures in-place MPI_Allreduce(MPI_SUM, MPI_FLOAT) latency on MPI_COMM_WORLD for each size
// in --sizes (bytes of float32 data), plus "grads200_each": 200 separate 40 KiB allreduces
// (8192000 bytes in all) timed as one sample, the way a trainer syncs unfused gradients.
//
// Per case: 2 warm-up calls, then each call (or each batch of 200) is timed on rank 0 with
// MPI_Wtime, with no barrier between iterations. The iteration count is fixed before timing
// (every rank must make the same number of calls): rank 0 estimates it from the second warm-up
// so the case takes about --seconds, clamped to [--min-iters, --max-iters], and broadcasts it.
// The result is verified once per case against the exact expected sum (small integers, so
// float32 sums are exact); a wrong value aborts with a nonzero exit. Timed iterations keep
// summing in place, so values grow (never toward subnormals); that does not change the cost.
//
// Rank 0 prints one JSON line per case:
//   {"impl":"openmpi","case":"allreduce","ranks":N,"bytes":B,"iters":I,
//    "median_us":x,"p10_us":x,"p90_us":x}
//
// Run (shared memory only; --allow-run-as-root, or OMPI_ALLOW_RUN_AS_ROOT=1 and
// OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, only when running as root):
//   mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,vader
//       --mca oob_tcp_if_include lo build/bench/mpi_allreduce --sizes 4096,67108864 --seconds 2
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
  kMaxSizes = 64,
  kWarmups = 2,
  kGradTensors = 200,
  kGradBytes = 40 * 1024,
};

typedef struct {
  int64_t sizes[kMaxSizes];
  int num_sizes;
  int min_iters;
  int max_iters;
  double seconds;
} Options;

static int rank_ = 0;
static int world_ = 1;

static void Die(const char* msg) {
  fprintf(stderr, "mpi_allreduce[rank %d]: %s\n", rank_, msg);
  MPI_Abort(MPI_COMM_WORLD, 2);
  exit(2);  // not reached
}

static void Usage(void) {
  if (rank_ == 0) {
    fprintf(stderr,
            "usage: mpi_allreduce [--sizes B1,B2,...] [--min-iters N] [--max-iters N] "
            "[--seconds S]\n  sizes are bytes of float32 data (multiples of 4)\n");
  }
  MPI_Finalize();
  exit(2);
}

// Accepts "--name value" and "--name=value"; returns the value or NULL if argv[*i] isn't --name.
static const char* FlagValue(int argc, char** argv, int* i, const char* name) {
  size_t n = strlen(name);
  if (strncmp(argv[*i], name, n) != 0) return NULL;
  if (argv[*i][n] == '=') return argv[*i] + n + 1;
  if (argv[*i][n] != '\0') return NULL;
  if (*i + 1 >= argc) Usage();
  return argv[++*i];
}

static int64_t ParseInt(const char* s, int64_t lo, int64_t hi) {
  char* end = NULL;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) Usage();
  return (int64_t)v;
}

static void ParseSizes(const char* list, Options* o) {
  char buf[4096];
  if (strlen(list) >= sizeof(buf)) Usage();
  strcpy(buf, list);
  o->num_sizes = 0;
  for (char* tok = strtok(buf, ","); tok != NULL; tok = strtok(NULL, ",")) {
    if (o->num_sizes == kMaxSizes) Usage();
    int64_t b = ParseInt(tok, 4, (int64_t)INT_MAX * 4);
    if (b % 4 != 0) Usage();
    o->sizes[o->num_sizes++] = b;
  }
  if (o->num_sizes == 0) Usage();
}

static Options ParseOptions(int argc, char** argv) {
  Options o = {{4096, 65536, 1 << 20, 16 << 20, 64 << 20, 256 << 20}, 6, 5, 200, 2.0};
  for (int i = 1; i < argc; ++i) {
    const char* v;
    if ((v = FlagValue(argc, argv, &i, "--sizes"))) {
      ParseSizes(v, &o);
    } else if ((v = FlagValue(argc, argv, &i, "--min-iters"))) {
      o.min_iters = (int)ParseInt(v, 1, 1000000);
    } else if ((v = FlagValue(argc, argv, &i, "--max-iters"))) {
      o.max_iters = (int)ParseInt(v, 1, 1000000);
    } else if ((v = FlagValue(argc, argv, &i, "--seconds"))) {
      char* end = NULL;
      o.seconds = strtod(v, &end);
      if (end == v || *end != '\0' || !(o.seconds > 0 && o.seconds <= 600)) Usage();
    } else {
      Usage();
    }
  }
  if (o.min_iters > o.max_iters) Usage();
  return o;
}

// Small integers: every partial sum is exact in float32.
static float Pattern(int rank, int64_t i) { return (float)(rank + 1 + (int)(i % 7)); }

static float Expected(int64_t i) {
  return (float)((int64_t)world_ * (world_ + 1) / 2 + (int64_t)world_ * (i % 7));
}

static void Fill(float* buf, int64_t count) {
  for (int64_t i = 0; i < count; ++i) buf[i] = Pattern(rank_, i);
}

static void Check(const float* buf, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (buf[i] != Expected(i)) {
      char msg[160];
      snprintf(msg, sizeof(msg), "wrong sum at element %lld: got %g want %g", (long long)i,
               (double)buf[i], (double)Expected(i));
      Die(msg);
    }
  }
}

// One timed unit: a single allreduce of bufs[0], or one per buffer (grads200_each).
static double RunOnce(float** bufs, int nbufs, int count) {
  double t0 = MPI_Wtime();
  for (int b = 0; b < nbufs; ++b) {
    if (MPI_Allreduce(MPI_IN_PLACE, bufs[b], count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) !=
        MPI_SUCCESS) {
      Die("MPI_Allreduce failed");
    }
  }
  return MPI_Wtime() - t0;
}

static int CompareDouble(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

// Linear interpolation between closest ranks (numpy's default); v must be sorted.
static double Percentile(const double* v, int n, double p) {
  double pos = p * (n - 1);
  int lo = (int)floor(pos);
  int hi = lo + 1 < n ? lo + 1 : lo;
  return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

static void RunCase(const Options* o, const char* name, int nbufs, int64_t bytes_each) {
  int64_t count = bytes_each / 4;
  float** bufs = malloc(sizeof(float*) * (size_t)nbufs);
  if (bufs == NULL) Die("out of memory");
  for (int b = 0; b < nbufs; ++b) {
    bufs[b] = malloc((size_t)bytes_each);
    if (bufs[b] == NULL) Die("out of memory");
    Fill(bufs[b], count);  // also faults the pages in before the warm-ups
  }

  double warm = 0;
  for (int w = 0; w < kWarmups; ++w) warm = RunOnce(bufs, nbufs, (int)count);
  for (int b = 0; b < nbufs; ++b) Fill(bufs[b], count);
  RunOnce(bufs, nbufs, (int)count);
  for (int b = 0; b < nbufs; ++b) Check(bufs[b], count);

  int iters = o->max_iters;
  if (rank_ == 0 && warm > 0 && o->seconds / warm < iters) iters = (int)(o->seconds / warm);
  if (iters < o->min_iters) iters = o->min_iters;
  MPI_Bcast(&iters, 1, MPI_INT, 0, MPI_COMM_WORLD);

  double* samples = malloc(sizeof(double) * (size_t)iters);
  if (samples == NULL) Die("out of memory");
  for (int it = 0; it < iters; ++it) samples[it] = RunOnce(bufs, nbufs, (int)count);

  if (rank_ == 0) {
    qsort(samples, (size_t)iters, sizeof(double), CompareDouble);
    printf(
        "{\"impl\":\"openmpi\",\"case\":\"%s\",\"ranks\":%d,\"bytes\":%lld,\"iters\":%d,"
        "\"median_us\":%.3f,\"p10_us\":%.3f,\"p90_us\":%.3f}\n",
        name, world_, (long long)(bytes_each * nbufs), iters, Percentile(samples, iters, 0.5) * 1e6,
        Percentile(samples, iters, 0.1) * 1e6, Percentile(samples, iters, 0.9) * 1e6);
    fflush(stdout);
  }
  free(samples);
  for (int b = 0; b < nbufs; ++b) free(bufs[b]);
  free(bufs);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  Options o = ParseOptions(argc, argv);
  for (int s = 0; s < o.num_sizes; ++s) RunCase(&o, "allreduce", 1, o.sizes[s]);
  RunCase(&o, "grads200_each", kGradTensors, kGradBytes);
  MPI_Finalize();
  return 0;
}
