#!/usr/bin/env bash
# ctest gpu.run_script_refuses_without_a_gpu_and_is_bounded: tests/gpu/run.sh on a machine
# without a usable GPU (exit 77 on one with a GPU: there run.sh itself is the test).
#   1. against this build (run_sh_test.sh BUILD_DIR): it refuses within seconds, exit 77 and the
#      "no usable GPU" line, after a probe that says what the machine is; at most 8 files.
#   2. against stub binaries whose first test passes only with NCCL's sandbox knobs (so it is
#      rerun once with them) and whose every later stage hangs: each
#      stage is cut at its bound, stages that no longer fit in the budget do not start (the
#      Python GPU tests, the torch benchmark and the overlap case without and with MPS too, each
#      reported), the whole run ends within its budget, exit 1, the summary says what timed out,
#      and no stub is left running. (Budget and stage bounds shortened through
#      GRADSYNC_GPU_BUDGET_S / _STAGE_S.)
set -uo pipefail
export LC_ALL=C
build=$(readlink -f "$1")
here=$(dirname "$(readlink -f "$0")")
if timeout 10 nvidia-smi -L >/dev/null 2>&1; then
  echo "a GPU is here: run tests/gpu/run.sh itself"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
check() {  # check WHAT CONDITION...
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fail=1; fi
}
files_in() { find "$1" -type f | wc -l; }

# ---- 1. refusal, with this build's binaries ----
if [[ -x $build/tests/gradsync_gpu_tests ]]; then
  start=$SECONDS
  OUT=$work/out1 GRADSYNC_BUILD_DIR=$build timeout 90 "$here/run.sh" >"$work/run1.txt" 2>&1
  rc=$?
  took=$((SECONDS - start))
  cat "$work/run1.txt"
  check "exit 77 without a GPU (got $rc)" test "$rc" -eq 77
  check "the 'no usable GPU' line" grep -q "run.sh: no usable GPU here" "$work/run1.txt"
  check "refused within 60 s (took $took s)" test "$took" -lt 60
  check "the probe printed the machine, the GPU, the libraries and torch" \
    bash -c "grep -q '== machine ==' '$work/out1/probe.txt' && grep -q '== GPU ==' '$work/out1/probe.txt' &&
             grep -q '== libraries' '$work/out1/probe.txt' && grep -q '== torch probe ==' '$work/out1/probe.txt'"
  check "at most 8 files in \$OUT ($(files_in "$work/out1"))" test "$(files_in "$work/out1")" -le 8
else
  echo "skipped part 1: $build/tests/gradsync_gpu_tests not built"
fi

# ---- 2. every stage bounded, with binaries that hang ----
stubs=$work/bin
mkdir -p "$stubs"
first=OneRankNcclOpsThroughTheDaemonWriteTheirOutputsInStreamOrder
cat >"$stubs/gradsync_gpu_tests" <<STUB
#!/bin/sh
echo \$\$ >>"$work/pids"
case "\$1" in
  *$first)  # passes only with NCCL's sandbox knobs, as if NCCL init failed without them
    echo "[ RUN      ] GpuTest.$first"
    [ "\${NCCL_CUMEM_ENABLE:-}" = 0 ] || { echo "[  FAILED  ] GpuTest.$first (1 ms)"; exit 1; }
    echo "[       OK ] GpuTest.$first (1 ms)"; exit 0 ;;
esac
exec sleep 1000
STUB
printf '#!/bin/sh\necho $$ >>"%s/pids"\nexec sleep 1000\n' "$work" >"$stubs/gradsyncd"
printf '#!/bin/sh\necho $$ >>"%s/pids"\nexec sleep 1000\n' "$work" >"$stubs/gpu_bench"
printf '#!/bin/sh\nexit 0\n' >"$stubs/gradsyncctl"
printf '#!/bin/sh\nexit 0\n' >"$stubs/gpu_worker"
chmod +x "$stubs"/*
start=$SECONDS
OUT=$work/out2 GRADSYNC_GPU_BIN_DIR=$stubs GRADSYNC_GPU_BUDGET_S=32 GRADSYNC_GPU_STAGE_S=7 \
  timeout 120 "$here/run.sh" >"$work/run2.txt" 2>&1
rc=$?
took=$((SECONDS - start))
grep -E '^(GpuTest|gpu_bench|run.sh|==|  )' "$work/run2.txt"
check "exit 1 when stages hang (got $rc)" test "$rc" -eq 1
check "within the 32 s budget (took $took s)" test "$took" -le 34
check "the failed first test was rerun once with NCCL's sandbox knobs" \
  grep -q "NCCL sandbox knobs on from here: NCCL_CUMEM_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 (the first test failed" \
  "$work/out2/summary.txt"
check "the benchmark ran after the first test, and was cut" grep -q "gpu_bench: exit 124" "$work/out2/summary.txt"
check "the hanging tests were cut, each said so" grep -q "timed out" "$work/out2/summary.txt"
check "past the budget, the rest did not start" grep -q "not run (no time left)" "$work/out2/summary.txt"
check "the Python GPU tests and the torch benchmark are reported" \
  bash -c "grep -q '^  python GPU tests: ' '$work/out2/summary.txt' &&
           grep -q '^  torch_gpu_allreduce: exit ' '$work/out2/summary.txt'"
check "the overlap case is reported, without and with MPS" \
  bash -c "grep -q '^  gpu_overlap: exit ' '$work/out2/summary.txt' &&
           grep -q '^  gpu_overlap --mps: exit ' '$work/out2/summary.txt'"
check "at most 8 files in \$OUT ($(files_in "$work/out2"))" test "$(files_in "$work/out2")" -le 8
sleep 1
left=0
while read -r pid; do kill -0 "$pid" 2>/dev/null && { left=1; kill "$pid"; }; done <"$work/pids"
check "no stub left running" test "$left" -eq 0
exit "$fail"
