#!/usr/bin/env bash
# Builds gradsync with clang under one sanitizer configuration and runs its C++ suite (ctest),
# printing the verdict and how long the build and the run took. Every clang build also checks the
# lock annotations (-Wthread-safety -Werror=thread-safety, CMakeLists.txt): a broken lock rule
# fails the build. Exits 77, saying why, when clang or its sanitizer runtimes are missing.
#
#   tests/sanitizers/run.sh address   ASan+UBSan into ./build-asan; with libFuzzer there, the fuzz
#                                     targets are built in it too (tests/fuzz/run.sh runs them with
#                                     BUILD_DIR=build-asan: one build for both)
#   tests/sanitizers/run.sh thread    TSan into ./build-tsan (suppressions: tsan.supp, third-party
#                                     code only; abseil's Mutex is annotated by tsan_absl_mutex.cc)
#   tests/sanitizers/run.sh thread build                     build only
#   CTEST_ARGS='-R Store' tests/sanitizers/run.sh thread    a part of the suite
#
# address runs the whole suite but the three 64 MiB collective tests (which outlast their deadlines
# under ASan with the fuzzer's coverage instrumentation on 2 cores; the gcc stage of .ci/run runs
# them) and the fault suite (Python trainers, which need the Python module this build lacks; the
# gcc stage runs it), unit and integration tests; thread runs the unit tests (label
# unit) but the etcd store's: the integration tests drive real gRPC processes, the etcd store
# talks gRPC to a real etcd, and Debian's gRPC is not built with TSan, so TSan cannot see its
# synchronisation and reports races inside gRPC's own call objects; they run under ASan+UBSan
# instead. The Python tests run in neither (a sanitized extension module
# cannot load into Debian's unsanitized interpreter).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
mode=${1:-}
what=${2:-all}
case $mode in
  address) flags=address,undefined build_dir=${BUILD_DIR:-build-asan} suite=${CTEST_ARGS--E SixtyFourMiB|^faults\.} ;;
  thread) flags=thread build_dir=${BUILD_DIR:-build-tsan} suite=${CTEST_ARGS--L unit -E Etcd} ;;
  *) sed -n '2,23p' "$0"; exit 2 ;;
esac
[[ $what == all || $what == build ]] || { sed -n '2,23p' "$0"; exit 2; }
jobs=$(nproc)
work=$(mktemp -d /tmp/gradsync-sanitize-XXXXXX)
trap 'rm -rf "$work"' EXIT

skip() {
  echo "sanitize $mode: SKIPPED: $*"
  exit 77
}
command -v clang++ >/dev/null && command -v clang >/dev/null ||
  skip "no clang/clang++ (Debian: apt-get install clang libclang-rt-14-dev)"
echo 'int main() { return 0; }' | clang++ -x c++ -fsanitize=$flags - -o "$work/probe" \
  2>"$work/probe.log" || skip "clang++ cannot link -fsanitize=$flags: $(head -c 300 "$work/probe.log")"

options=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
  -DGRADSYNC_SANITIZE=$mode -DGRADSYNC_BUILD_TESTS=ON -DGRADSYNC_BUILD_BENCH=OFF
  -DGRADSYNC_WITH_CUDA=OFF -DPython3_EXECUTABLE=/usr/bin/python3)
if [[ $mode == address ]]; then
  # libFuzzer present: the same build carries the fuzz targets (coverage-instrumented throughout).
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o "$work/fuzz-probe" 2>/dev/null &&
    options+=(-DGRADSYNC_FUZZ=ON) || options+=(-DGRADSYNC_FUZZ=OFF)
fi

start=$SECONDS
cmake -S . -B "$build_dir" "${options[@]}" >"$work/configure.log" ||
  { cat "$work/configure.log"; echo "sanitize $mode: FAILED (configure)"; exit 1; }
if ! cmake --build "$build_dir" -j"$jobs" >"$work/build.log" 2>&1; then
  grep -E -B2 -A8 'error|Error' "$work/build.log" | head -n 80
  echo "sanitize $mode: FAILED (build, $((SECONDS - start)) s)"
  exit 1
fi
built=$((SECONDS - start))
echo "sanitize $mode: built in $built s"
[[ $what == build ]] && exit 0

# Every process of the suite (the daemons and workers the tests start too) writes its reports to
# $work/reports/<sanitizer>.<pid>: a report fails the stage even where a test does not look at
# that process's exit status.
mkdir -p "$work/reports"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}:log_path=$work/reports/asan
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}:log_path=$work/reports/ubsan
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}:suppressions=$PWD/tests/sanitizers/tsan.supp:log_path=$work/reports/tsan
start=$SECONDS
rc=0
# shellcheck disable=SC2086  # $suite: words
(cd "$build_dir" && ctest --output-on-failure -j"$jobs" $suite) >"$work/ctest.log" 2>&1 || rc=$?
ran=$((SECONDS - start))
reports=("$work"/reports/*)
[[ -e ${reports[0]} ]] || reports=()
if ((rc != 0 || ${#reports[@]})); then
  # The failing tests' output, the sanitizers' reports, then ctest's summary.
  grep -v -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed' "$work/ctest.log" | tail -n 200
  for r in "${reports[@]}"; do
    echo "--- $(basename "$r") (the process's sanitizer report)"
    head -n 80 "$r"
  done
  echo "sanitize $mode: FAILED (ctest exit $rc, ${#reports[@]} sanitizer report(s); built in" \
    "$built s, tests ran $ran s)"
  exit 1
fi
tail -n 3 "$work/ctest.log"
echo "sanitize $mode: OK (built in $built s, tests ran $ran s)"
