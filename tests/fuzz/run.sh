#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, GRADSYNC_FUZZ=ON, into ./build-fuzz) and runs each for a
# bounded time, all at once, over a copy of its seed corpus (tests/fuzz/corpus/<target>/, which
# holds the inputs past runs found too: each run replays them first). Fails when a target finds
# a crash, a leak, a timeout or a broken invariant; what it found is kept in
# build-fuzz/fuzz-artifacts/<target>/ (fix it, then add the input to the corpus as
# regression-<what>). Exits 77, saying why, when clang or libFuzzer is missing.
#
#   tests/fuzz/run.sh                  every target, FUZZ_SECONDS (60) each
#   tests/fuzz/run.sh doorbell_fuzzer  one target
#   FUZZ_SECONDS=0 tests/fuzz/run.sh   replay the corpus only
#   BUILD_DIR=build-asan tests/fuzz/run.sh   in the ASan+UBSan build of tests/sanitizers/run.sh
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
build_dir=${BUILD_DIR:-build-fuzz}
seconds=${FUZZ_SECONDS:-60}
targets=("$@")
((${#targets[@]})) || targets=(doorbell_fuzzer op_request_fuzzer store_request_fuzzer)

work=$(mktemp -d /tmp/gradsync-fuzz-XXXXXX)
trap 'rm -rf "$work"' EXIT

skip() {
  echo "fuzz: SKIPPED: $*"
  exit 77
}
command -v clang++ >/dev/null && command -v clang >/dev/null ||
  skip "no clang/clang++ (Debian: apt-get install clang libclang-rt-14-dev)"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
  clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o "$work/probe" 2>"$work/probe.log" ||
  skip "clang++ cannot link -fsanitize=fuzzer,address,undefined (libFuzzer missing: Debian's" \
    "libclang-rt-14-dev): $(head -c 300 "$work/probe.log")"

start=$SECONDS
# A build with the fuzz targets already configured (CI: tests/sanitizers/run.sh address made
# build-asan so) is used as it is: one ASan+UBSan build for the fuzz targets and the test suite.
if ! grep -qx 'GRADSYNC_FUZZ:BOOL=ON' "$build_dir/CMakeCache.txt" 2>/dev/null; then
  cmake -S . -B "$build_dir" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_FUZZ=ON -DGRADSYNC_BUILD_TESTS=OFF \
    -DGRADSYNC_BUILD_BENCH=OFF -DGRADSYNC_WITH_CUDA=OFF >"$work/configure.log" ||
    { cat "$work/configure.log"; exit 1; }
fi
cmake --build "$build_dir" -j"$(nproc)" --target "${targets[@]}"
build_dir=$(readlink -f "$build_dir")
echo "fuzz: built in $((SECONDS - start)) s; running ${targets[*]} for ${seconds} s each"

declare -A pids
for t in "${targets[@]}"; do
  mkdir -p "$work/$t" "$build_dir/fuzz-artifacts/$t"
  cp -r "tests/fuzz/corpus/$t" "$work/$t/corpus"
  args=(-timeout=10 -rss_limit_mb=2048 -artifact_prefix="$build_dir/fuzz-artifacts/$t/")
  if ((seconds > 0)); then
    args+=(-max_total_time="$seconds" -print_final_stats=1 "$work/$t/corpus")
  else
    args+=("$work/$t/corpus"/*)  # each input once
  fi
  # -max_total_time bounds the run; timeout(1) only a target that stops answering its alarm.
  timeout -k 10 $((seconds + 300)) "$build_dir/tests/fuzz/$t" "${args[@]}" >"$work/$t/log" 2>&1 &
  pids[$t]=$!
done

failed=()
for t in "${targets[@]}"; do
  rc=0
  wait "${pids[$t]}" || rc=$?
  if ((rc == 0)); then
    runs=$(sed -n 's/^stat::number_of_executed_units: //p' "$work/$t/log")
    echo "fuzz: $t OK (${runs:-$(ls "$work/$t/corpus" | wc -l)} inputs)"
  else
    failed+=("$t")
    echo "fuzz: $t FAILED (exit $rc); the end of its log:"
    grep -v -E '^#[0-9]+ +(NEW|REDUCE|pulse)' "$work/$t/log" | tail -n 40
    ls -l "$build_dir/fuzz-artifacts/$t"
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets OK in $((SECONDS - start)) s"
