#!/usr/bin/env bash
# The GPU checks, in one bounded call on a GPU machine (one H200 here), stage by stage:
#   1. probe      what the machine is (kernel, /dev/shm, nvidia-smi, libraries, torch, a torch
#                 CUDA-IPC probe): tests/gpu/probe.sh, seconds
#   2. first test one-rank NCCL ops through the daemon with value checks; if it fails, rerun once
#                 with NCCL's sandbox knobs (NCCL_CUMEM_ENABLE=0 NCCL_SOCKET_IFNAME=lo
#                 NCCL_IB_DISABLE=1), which then stay on. Skipped (no GPU): exit 77 at once.
#   3. benchmark  the daemon path against direct NCCL on the same buffers (bench/gpu_bench.cc),
#                 then gradsync.all_reduce on CUDA tensors against torch.distributed NCCL
#                 (bench/torch_gpu_allreduce.py, the machine's own Python and torch), then the
#                 overlap case (bench/gpu_overlap.py: step time of a compute loop reducing
#                 25 MiB buckets through a daemon of its own against in-process torch NCCL),
#                 once without MPS and once with --mps (it starts MPS where the machine lets
#                 it, else says why and measures without), at most 90 s each; all only if the
#                 first test passed
#   4. the other gpu tests, each its own process under its own timeout
#   5. the Python GPU tests with the machine's own torch (tests/gpu/test_python_gpu.py: CUDA
#                 tensors through the daemon, a one-rank DistributedOptimizer against a plain
#                 optimizer, the DDP hook, two one-rank jobs on one GPU at once, async ops
#                 on two groups over one allocation exact, 1,000 re-registrations at reused
#                 addresses)
#   6. one table of every benchmark, printed last and written with the GPU, driver, CUDA,
#                 NCCL and torch versions to $OUT/results.json and bench/results-DATE-gpu.json
#                 (tests/gpu/results.py)
# Whatever hangs, the whole run ends within GRADSYNC_GPU_BUDGET_S (default 420 s; the device
# call allows 480): every stage runs under `timeout`, clamped to the time left.
#
# Binaries: $GRADSYNC_BUILD_DIR (a build tree of this checkout), else $GRADSYNC_GPU_BIN_DIR (a
# flat folder of them), else build-gpu-bundle/ (tests/gpu/bundle.sh, for machines without
# Debian's libraries; refused if built from other sources), else, with GRADSYNC_GPU_BUILD=1, a
# build of this tree; without any of them it stops at once saying how to bring the bundle.
# LD_LIBRARY_PATH (the bundle's libraries, CUDA's, NCCL's) is given to the daemon and the test
# and benchmark binaries only, never to Python: torch's Python keeps its own libssl and libz
# (the bundle holds Debian 12's). The Python scripts that start a daemon pass it on themselves
# (GRADSYNC_DAEMON_LD_LIBRARY_PATH); libgradsync_c.so finds the bundle's libraries by its RPATH.
# The machine: gVisor or a full VM (tests/gpu/sandbox.sh), said after the probe with the GPU
# features that cannot work there.
# The Python package: this tree's client/python/gradsync over the binaries' libgradsync_c.so
# (GRADSYNC_LIBRARY), so its Python files are never older than the tree.
# Files in $OUT (at most 8): summary.txt probe.txt gpu_tests.log (C++ and Python tests)
# gpu_bench.txt (every benchmark's output) bench.err results.json gradsyncd.log [build.log].
# Exit 0: all passed; 77: no usable GPU (nothing run but the probe); 1: something failed or
# timed out (summary.txt says what).
set -uo pipefail
export LC_ALL=C
cd "$(dirname "$(readlink -f "$0")")/../.."
budget=${GRADSYNC_GPU_BUDGET_S:-420}
stage_cap=${GRADSYNC_GPU_STAGE_S:-600}  # tests of this script shorten every stage
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
rm -f "$out"/*.tmp
tmp=$(mktemp -d)
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $((SECONDS)); }
# bounded MAX CMD...: CMD under `timeout`, at most MAX seconds, never past the budget (10 s
# kept for the summary). 124 or 137: it timed out; 125: no time was left to start it.
bounded() {
  local max=$1 left
  shift
  ((max > stage_cap)) && max=$stage_cap
  left=$((budget - SECONDS - 10))
  ((left < max)) && max=$left
  if ((max < 3)); then
    say "run.sh: no time left for: $(basename "$1")"
    return 125
  fi
  timeout -k 5 "$max" "$@"
}

if [[ -n ${GRADSYNC_BUILD_DIR:-} ]]; then
  b=$(readlink -f "$GRADSYNC_BUILD_DIR")
  daemon=$b/daemon/gradsyncd ctl=$b/client/gradsyncctl tests=$b/tests/gradsync_gpu_tests
  worker_dir=$b/tests bench=$b/bench/gpu_bench libs= gslib=$b/client/libgradsync_c.so
elif [[ -n ${GRADSYNC_GPU_BIN_DIR:-} || -d build-gpu-bundle/bin ]]; then
  if [[ -z ${GRADSYNC_GPU_BIN_DIR:-} ]]; then
    . tests/gpu/source_hash.sh
    if [[ $(cat build-gpu-bundle/SOURCE_HASH 2>/dev/null) != "$(source_hash)" ]]; then
      say "run.sh: build-gpu-bundle/ was built from other sources: run tests/gpu/bundle.sh again"
      exit 1
    fi
    libs=$PWD/build-gpu-bundle/lib
  else
    libs=
  fi
  b=$(readlink -f "${GRADSYNC_GPU_BIN_DIR:-build-gpu-bundle/bin}")
  daemon=$b/gradsyncd ctl=$b/gradsyncctl tests=$b/gradsync_gpu_tests worker_dir=$b
  bench=$b/gpu_bench gslib=$b/libgradsync_c.so
elif [[ ${GRADSYNC_GPU_BUILD:-} != 1 ]]; then
  say "run.sh: no binaries: build-gpu-bundle/ did not come along with this tree. On the build"
  say "  machine run tests/gpu/bundle.sh, then run tests/gpu/run.sh carrying build-gpu-bundle"
  say "  (the device tool's carry: [\"build-gpu-bundle\"]); or set GRADSYNC_BUILD_DIR or"
  say "  GRADSYNC_GPU_BIN_DIR, or GRADSYNC_GPU_BUILD=1 to build here (needs Debian's gRPC)"
  exit 1
else
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DGRADSYNC_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DPython3_EXECUTABLE=/usr/bin/python3 >"$out/build.log" 2>&1 &&
    bounded 400 cmake --build build-gpu -j"$(nproc)" --target gradsyncd gradsyncctl \
      gradsync_gpu_tests gpu_worker gpu_bench gradsync_c >>"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log"; say "run.sh: build failed"; exit 1; }
  b=$PWD/build-gpu
  daemon=$b/daemon/gradsyncd ctl=$b/client/gradsyncctl tests=$b/tests/gradsync_gpu_tests
  worker_dir=$b/tests bench=$b/bench/gpu_bench libs= gslib=$b/client/libgradsync_c.so
fi
# CUDA and NCCL of this machine: the toolkit's, else the pip wheels' (nvidia-*-cu13), wherever
# the wheels put libcudart.so.13 and libnccl.so.2.
wheels=$(timeout 20 python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
wheel_libs=
if [[ -n $wheels ]]; then
  wheel_libs=$(find "$wheels" \( -name 'libcudart.so.13*' -o -name 'libnccl.so.2*' \) -printf '%h\n' \
    2>/dev/null | sort -u | paste -sd: -)
fi
path=
for d in "$libs" "$wheel_libs" /usr/local/cuda/lib64 ${LD_LIBRARY_PATH:+"$LD_LIBRARY_PATH"}; do
  [[ -n $d ]] && path=${path:+$path:}$d  # no empty entries (they mean the current directory)
done
# Only for the binaries ("${bin[@]}" BINARY ...); Python scripts pass it to the daemons they start.
bin=(env "LD_LIBRARY_PATH=$path")
export GRADSYNC_DAEMON_LD_LIBRARY_PATH=$path
export GRADSYNC_DAEMON_PATH=$daemon GRADSYNC_TEST_BIN_DIR=$worker_dir
export GRADSYNC_LIBRARY=$gslib PYTHONPATH=$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # NCCL's own reasons, in the logs

# ---- 1. probe ----
GRADSYNC_BIN_LD_LIBRARY_PATH=$path bounded 60 tests/gpu/probe.sh "$daemon" "$ctl" "$tests" "$worker_dir/gpu_worker" "$bench" \
  "$gslib" >"$out/probe.txt" 2>&1
cat "$out/probe.txt"
knobs=(NCCL_CUMEM_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1)
use_knobs() {
  say "run.sh: NCCL sandbox knobs on from here: ${knobs[*]} ($1)"
  export "${knobs[@]}"
}
. tests/gpu/sandbox.sh
sandbox=$(gpu_sandbox "$(grep -m1 '^Linux ' "$out/probe.txt")" "$(grep -m1 '^sandbox: ' "$out/probe.txt")")
if [[ $sandbox == gvisor ]]; then
  say "run.sh: machine: gVisor (nvproxy); GPU features that cannot work here:"
  gpu_sandbox_limits gvisor | sed 's/^/  /' | tee -a "$summary"
else
  say "run.sh: machine: a full VM or bare metal (NVIDIA's kernel module): every GPU feature can work"
fi
# gVisor or a torch that cannot share CUDA memory: start with the knobs.
if [[ $sandbox == gvisor ]] || grep -q 'IPC event FAILED' "$out/probe.txt"; then
  use_knobs "the probe saw a sandbox"
fi

# ---- gpu tests, one per process ----
: >"$out/gpu_tests.log"
declare -A result
# run_test NAME MAX: GpuTest.NAME alone, at most MAX seconds; sets result[NAME].
run_test() {
  local name=$1 max=$2 rc log=$tmp/$1.log
  bounded "$max" "${bin[@]}" "$tests" --gtest_filter="GpuTest.$name" --gtest_color=no >"$log" 2>&1
  rc=$?
  { echo "=== GpuTest.$name: exit $rc after $(elapsed) s"; cat "$log"; } >>"$out/gpu_tests.log"
  if grep -q "^\[  SKIPPED \] GpuTest.$name" "$log"; then
    result[$name]=skipped
  elif ((rc == 0)) && grep -q "^\[       OK \] GpuTest.$name" "$log"; then
    result[$name]=passed
  elif ((rc == 124 || rc == 137)); then
    result[$name]="timed out"
  elif ((rc == 125)); then
    result[$name]="not run (no time left)"
  else
    result[$name]="failed (exit $rc)"
  fi
  say "GpuTest.$name: ${result[$name]} ($(elapsed) s)"
}

first=OneRankNcclOpsThroughTheDaemonWriteTheirOutputsInStreamOrder
run_test "$first" 75
if [[ ${result[$first]} == skipped ]]; then
  grep -m1 -A1 'Skipped' "$tmp/$first.log"
  say "run.sh: no usable GPU here: gpu tests skipped, benchmark not run"
  rm -rf "$tmp"
  exit 77
fi
if [[ ${result[$first]} != passed && -z ${NCCL_CUMEM_ENABLE:-} ]]; then
  use_knobs "the first test ${result[$first]}"
  run_test "$first" 75
fi

# ---- 3. benchmarks (only on a first test that passed) ----
bench_rc=skipped torch_bench_rc=skipped overlap_rc=skipped overlap_mps_rc=skipped
if [[ ${result[$first]} == passed ]]; then
  dir=$(mktemp -d)
  "${bin[@]}" "$daemon" --socket="$dir/d.sock" --port=-1 --log_sink=stderr --log_level=warning \
    --op_timeout=30s 2>"$out/gradsyncd.log" &
  daemon_pid=$!
  for _ in $(seq 1 50); do
    timeout 2 "${bin[@]}" "$ctl" --socket="$dir/d.sock" health >/dev/null 2>&1 && break
    sleep 0.2
  done
  left=$((budget - SECONDS - 10 - 5 * 60))  # keep five minutes for the tests
  ((left > 120)) && left=120
  ((left < 30)) && left=30
  bounded "$left" "${bin[@]}" "$bench" --socket="$dir/d.sock" --iters=20 --json="$tmp/gpu_bench.json" \
    --budget_s=$((left - 25)) --init_timeout_s=20 --op_timeout_ms=20000 \
    >"$out/gpu_bench.txt" 2>"$out/bench.err"
  bench_rc=$?
  say "gpu_bench: exit $bench_rc ($(elapsed) s)"
  left=$((budget - SECONDS - 10 - 4 * 60))
  ((left > 60)) && left=60
  ((left < 20)) && left=20
  echo >>"$out/gpu_bench.txt"
  bounded "$left" python3 bench/torch_gpu_allreduce.py --socket="$dir/d.sock" \
    --json="$tmp/torch_bench.json" --budget_s=$((left - 15)) \
    >>"$out/gpu_bench.txt" 2>>"$out/bench.err"
  torch_bench_rc=$?
  say "torch_gpu_allreduce: exit $torch_bench_rc ($(elapsed) s)"
  kill "$daemon_pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$daemon_pid" 2>/dev/null
  wait "$daemon_pid" 2>/dev/null
  rm -rf "$dir"
  # The overlap case starts its own daemon (with --mps, a client of the MPS it starts).
  for mps in "" --mps; do
    left=$((budget - SECONDS - 10 - 150))  # keep two and a half minutes for the tests
    ((left > 90)) && left=90
    ((left < 45)) && left=45
    echo >>"$out/gpu_bench.txt"
    bounded "$left" python3 bench/gpu_overlap.py --daemon "$daemon" ${mps:+"$mps"} \
      --json="$tmp/overlap${mps:+_mps}.json" --budget_s=$((left - 10)) \
      >>"$out/gpu_bench.txt" 2>>"$out/bench.err"
    rc=$?
    if [[ -n $mps ]]; then overlap_mps_rc=$rc; else overlap_rc=$rc; fi
    say "gpu_overlap${mps:+ $mps}: exit $rc ($(elapsed) s)"
  done
else
  say "gpu_bench: skipped (the first gpu test did not pass)"
fi

# ---- 4. the other tests ----
for name in TwoTrainerProcessesShareTheGpuAndTheDaemon \
  ATrainerKilledWhileItsBufferIsMappedLeavesTheDaemonHealthy \
  APeerThatNeverJoinsAbortsAtTheDeadlineAndTheDaemonGoesOn \
  ARestartedTrainerReusesTheDaemonsCommunicators; do
  run_test "$name" 75
done

# ---- 5. the Python GPU tests, the machine's own Python and torch ----
bounded 150 python3 tests/gpu/test_python_gpu.py --daemon "$daemon" >"$tmp/python.log" 2>&1
py_rc=$?
{ echo "=== tests/gpu/test_python_gpu.py: exit $py_rc after $(elapsed) s"; cat "$tmp/python.log"; } \
  >>"$out/gpu_tests.log"
grep -E '^(PASS|FAIL|SKIP) ' "$tmp/python.log" | cut -c1-200 | sed 's/^/python: /' | tee -a "$summary"
case $py_rc in
  0) py_result=passed ;;
  124 | 137) py_result="timed out" ;;
  125) py_result="not run (no time left)" ;;
  77) py_result="skipped (torch sees no GPU)" ;;
  *) py_result="failed (exit $py_rc)" ;;
esac
say "tests/gpu/test_python_gpu.py: $py_result ($(elapsed) s)"

echo
say "== summary after $(elapsed) s =="
ok=1
for name in "$first" TwoTrainerProcessesShareTheGpuAndTheDaemon \
  ATrainerKilledWhileItsBufferIsMappedLeavesTheDaemonHealthy \
  APeerThatNeverJoinsAbortsAtTheDeadlineAndTheDaemonGoesOn \
  ARestartedTrainerReusesTheDaemonsCommunicators; do
  say "  GpuTest.$name: ${result[$name]:-not run}"
  [[ ${result[$name]:-} == passed ]] || ok=0
done
say "  python GPU tests: $py_result"
[[ $py_result == passed ]] || ok=0
say "  gpu_bench: exit $bench_rc"
[[ $bench_rc == 0 ]] || ok=0
say "  torch_gpu_allreduce: exit $torch_bench_rc"
[[ $torch_bench_rc == 0 ]] || ok=0
say "  gpu_overlap: exit $overlap_rc"
[[ $overlap_rc == 0 ]] || ok=0
say "  gpu_overlap --mps: exit $overlap_mps_rc"
[[ $overlap_mps_rc == 0 ]] || ok=0
[[ -s $out/bench.err ]] && tail -5 "$out/bench.err" | tee -a "$summary"
# ---- 6. one table, last ----
if [[ -s $tmp/gpu_bench.json || -s $tmp/torch_bench.json ]]; then
  driver=$(timeout 10 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  echo
  timeout 20 python3 tests/gpu/results.py --out "$out/results.json" --cpp "$tmp/gpu_bench.json" \
    --torch "$tmp/torch_bench.json" --overlap "$tmp/overlap.json" \
    --overlap "$tmp/overlap_mps.json" --driver "$driver" \
    --copy "bench/results-$(date -u +%F)-gpu.json" 2>&1 | tee -a "$summary"
fi
rm -rf "$tmp"
rm -f "$out"/*.tmp
((ok == 1))
