#!/usr/bin/env bash
# The GPU checks, in one run on a GPU machine (one H200 here): the gpu tests (CUDA IPC buffers
# and events between trainer processes and a real daemon, NCCL through the daemon, a trainer
# killed while mapped, abort at the deadline), then the benchmark (the daemon path against
# direct ncclAllReduce, 4 KiB ... 1 GiB), and a short table last. Under 5 minutes.
#
# Binaries: build-gpu-bundle/ when present (tests/gpu/bundle.sh, for machines without Debian's
# libraries), else a build of this tree into build-gpu (needs ./setup.sh's packages).
# Outputs also go to $OUT when set. Exit 0: passed; 77: no usable GPU here (tests skipped).
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
out=${OUT:-$(mktemp -d)}
if [[ -d build-gpu-bundle/bin ]]; then
  . tests/gpu/source_hash.sh
  if [[ $(cat build-gpu-bundle/SOURCE_HASH 2>/dev/null) != "$(source_hash)" ]]; then
    echo "run.sh: build-gpu-bundle/ was built from other sources: run tests/gpu/bundle.sh again"
    exit 1
  fi
  bin=build-gpu-bundle/bin
  libs=$PWD/build-gpu-bundle/lib
else
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DGRADSYNC_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DPython3_EXECUTABLE=/usr/bin/python3 >/dev/null &&
    cmake --build build-gpu -j"$(nproc)" --target gradsyncd gradsyncctl gradsync_gpu_tests \
      gpu_worker gpu_bench >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  mkdir -p build-gpu/run-bin
  cp build-gpu/daemon/gradsyncd build-gpu/client/gradsyncctl build-gpu/tests/gradsync_gpu_tests \
    build-gpu/tests/gpu_worker build-gpu/bench/gpu_bench build-gpu/run-bin/
  bin=build-gpu/run-bin
  libs=
fi
bin=$(readlink -f "$bin")
# CUDA and NCCL of this machine: the toolkit's, else the pip wheels' (nvidia-*-cu13), wherever
# the wheels put libcudart.so.13 and libnccl.so.2.
wheels=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
wheel_libs=
if [[ -n $wheels ]]; then
  wheel_libs=$(find "$wheels" \( -name 'libcudart.so.13*' -o -name 'libnccl.so.2*' \) -printf '%h\n' \
    2>/dev/null | sort -u | paste -sd: -)
fi
path=
for d in "$libs" "$wheel_libs" /usr/local/cuda/lib64 ${LD_LIBRARY_PATH:+"$LD_LIBRARY_PATH"}; do
  [[ -n $d ]] && path=${path:+$path:}$d  # no empty entries (they mean the current directory)
done
export LD_LIBRARY_PATH=$path
export GRADSYNC_DAEMON_PATH=$bin/gradsyncd GRADSYNC_TEST_BIN_DIR=$bin
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # NCCL's own reasons, in the logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 | tee "$out/gpu.txt"

timeout 240 "$bin/gradsync_gpu_tests" 2>&1 | tee "$out/gpu_tests.log" | grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|PASSED|FAILED'
tests_rc=${PIPESTATUS[0]}
if grep -q 'SKIPPED' "$out/gpu_tests.log" && ! grep -q '\[       OK \]' "$out/gpu_tests.log"; then
  grep -m1 -A1 'Skipped' "$out/gpu_tests.log"
  echo "run.sh: no usable GPU here: gpu tests skipped, benchmark not run"
  exit 77
fi

dir=$(mktemp -d)
"$bin/gradsyncd" --socket="$dir/d.sock" --port=-1 --log_sink=stderr --log_level=warning 2>"$out/gradsyncd.log" &
daemon=$!
for _ in $(seq 1 100); do "$bin/gradsyncctl" --socket="$dir/d.sock" health >/dev/null 2>&1 && break; sleep 0.1; done
timeout 200 "$bin/gpu_bench" --socket="$dir/d.sock" --iters=30 >"$out/gpu_bench.txt" 2>"$out/gpu_bench.err"
bench_rc=$?
kill $daemon; wait $daemon 2>/dev/null

echo
echo "== gpu tests: exit $tests_rc =="
grep -E '^\[ +(OK|FAILED|SKIPPED) +\]' "$out/gpu_tests.log"
echo "== all-reduce, one rank: daemon path vs direct ncclAllReduce (median us per op): exit $bench_rc =="
cat "$out/gpu_bench.txt"
[[ -s $out/gpu_bench.err ]] && tail -5 "$out/gpu_bench.err"
((tests_rc == 0 && bench_rc == 0))
