#!/usr/bin/env bash
# gradsync's one setup script.
#
#   ./setup.sh           install the Debian packages gradsync needs (idempotent; root)
#   ./setup.sh build     ... then configure and build into ./build (GRADSYNC_SANITIZE=1: ./build-asan)
#   ./setup.sh test      ... then run every test (ctest; pytest when tests/python exists)
#   ./setup.sh demo      ... then run the main job on this machine: a real gradsyncd hosting the
#                        job's store, and 4 trainer processes talking to it over its unix socket
#   ./setup.sh bench     ... then run the benchmarks against their peers (minutes)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"

packages=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libspdlog-dev libfmt-dev libsystemd-dev
  libgtest-dev libgmock-dev googletest
  libgloo-dev pybind11-dev python3-dev
  python3-torch python3-grpcio python3-pytest python3-numpy
  openmpi-bin libopenmpi-dev
  iproute2 systemd procps
)
PY=/usr/bin/python3  # Debian's torch imports only here
sanitize=${GRADSYNC_SANITIZE:-0}
build_dir=${BUILD_DIR:-build}
[[ $sanitize == 1 && -z ${BUILD_DIR:-} ]] && build_dir=build-asan

install_packages() {
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "setup: all ${#packages[@]} packages present"
    return
  fi
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: packages installed"
}

build() {
  local san=OFF
  [[ $sanitize == 1 ]] && san=ON
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=$san \
    -DPython3_EXECUTABLE=$PY >/dev/null
  cmake --build "$build_dir" -j"$(nproc)"
}

run_tests() {
  local rc=0
  (cd "$build_dir" && ctest --output-on-failure -j"$(nproc)") || rc=$?
  if [[ -d tests/python ]] && compgen -G "tests/python/test_*.py" >/dev/null; then
    GRADSYNC_BUILD_DIR=$PWD/$build_dir $PY -m pytest -q tests/python || rc=$?
  fi
  return $rc
}

demo() {
  local dir world=4 pids=() r rc=0
  dir=$(mktemp -d /tmp/gradsync-demo-XXXXXX)
  local sock=$dir/gradsyncd.sock ctl="$build_dir/client/gradsyncctl --socket=$dir/gradsyncd.sock"
  "$build_dir/daemon/gradsyncd" --socket="$sock" --port=0 --log_sink=stderr 2>"$dir/gradsyncd.log" &
  local daemon=$!
  trap 'kill $daemon 2>/dev/null || true; rm -rf "$dir"' RETURN
  for _ in $(seq 1 200); do $ctl health >/dev/null 2>&1 && break; sleep 0.05; done
  $ctl health
  for ((r = 0; r < world; r++)); do
    "$build_dir/client/gradsync-demo-trainer" --socket="$sock" --job=demo --rank=$r \
      --world_size=$world &
    pids+=($!)
  done
  # While the trainers stay attached (they wait for 'released'): what an operator sees.
  local done=0
  for _ in $(seq 1 600); do
    done=$($ctl --job=demo --timeout=1s store get done 2>/dev/null || echo 0)
    [[ $done == "$world" ]] && break
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 0.1
  done
  $ctl sessions || rc=1
  $ctl --job=demo packlist show world || rc=1
  $ctl --job=demo store set released 1 || rc=1
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "after the trainers left (the job's state is gone with it):"
  $ctl jobs || rc=1
  kill -TERM $daemon
  wait $daemon || rc=1
  echo "--- gradsyncd log ---"
  cat "$dir/gradsyncd.log"
  if ((rc == 0)); then echo "demo: OK"; else echo "demo: FAILED"; fi
  return $rc
}

case ${1:-install} in
  install) install_packages ;;
  build) install_packages && build ;;
  test) install_packages && build && run_tests ;;
  demo) install_packages && build && demo ;;
  bench) install_packages && build && $PY bench/collective_bench.py --build "$build_dir" &&
    $PY bench/store_bench.py --build "$build_dir" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
