#!/usr/bin/env bash
# gradsync's one setup script.
#
#   ./setup.sh           install the Debian packages gradsync needs (idempotent; root), and a
#                        virtual environment ./.venv (GRADSYNC_VENV) with the pinned torch 2.x
#                        from PyPI (fetched once: kept while it holds that version)
#   ./setup.sh build     ... then configure and build into ./build (GRADSYNC_SANITIZE=address, or
#                        1: clang, ASan+UBSan, ./build-asan; =thread: TSan, ./build-tsan; both
#                        through tests/sanitizers/run.sh)
#   ./setup.sh test      ... then run every test (ctest; tests/python under Debian's torch 1.13
#                        and again under the pinned torch 2.x)
#   ./setup.sh demo      ... then run the main job on this machine: a real gradsyncd hosting the
#                        job's store, and the example PyTorch trainer under torch 2.x's
#                        torchrun, 4 ranks
#   ./setup.sh bench     ... then run the benchmarks against their peers (minutes)
#   ./setup.sh package   ... then build the Debian packages gradsyncd, libgradsync-dev and
#                        python3-gradsync into ./build/packages (cmake/Packaging.cmake);
#                        install them with `apt install ./build/packages/*.deb`
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"

packages=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libspdlog-dev libfmt-dev libsystemd-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev googletest
  clang libclang-rt-14-dev
  python3-torch python3-grpcio python3-pytest python3-numpy python3-venv
  openmpi-bin libopenmpi-dev
  iproute2 systemd procps
  etcd-server etcd-client
  dpkg-dev lintian groff-base
  debootstrap buildah
)
PY=/usr/bin/python3  # Debian's torch imports only here
# torch 2.x: PyPI's Linux build (a CUDA build; it runs on the CPU), in a virtual environment that
# also sees Debian's packages (grpcio, pytest, numpy); its own torch comes first.
TORCH2=2.15.0
VENV=${GRADSYNC_VENV:-$PWD/.venv}
PY2=$VENV/bin/python
# expecttest: torch's own distributed tests (tests/python/test_torch_upstream.py) import it.
# kubernetes-validate: the Kubernetes API's JSON schemas, offline (tests/deploy/kubernetes_test.sh).
venv_packages=("torch==$TORCH2" expecttest==0.3.0 kubernetes-validate==1.30.0)
case ${GRADSYNC_SANITIZE:-0} in
  0 | OFF | off | "") sanitize= ;;
  1 | ON | on | address) sanitize=address ;;
  thread) sanitize=thread ;;
  *) echo "setup: GRADSYNC_SANITIZE=$GRADSYNC_SANITIZE: want 0, 1/address or thread" >&2; exit 2 ;;
esac
build_dir=${BUILD_DIR:-build}
[[ $sanitize == address && -z ${BUILD_DIR:-} ]] && build_dir=build-asan
[[ $sanitize == thread && -z ${BUILD_DIR:-} ]] && build_dir=build-tsan

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
  # Explicit exits: callers chain this with &&, where bash's errexit does not apply.
  apt-get update -qq || { echo "setup: apt-get update failed" >&2; exit 1; }
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    { echo "setup: apt-get install failed: ${missing[*]}" >&2; exit 1; }
  echo "setup: packages installed"
}

install_venv() {
  if [[ -x $PY2 ]] && $PY2 -c 'import importlib.metadata as m, sys
sys.exit(any(m.version(n) != v for n, v in (p.split("==") for p in sys.argv[1:])))' \
    "${venv_packages[@]}" 2>/dev/null; then
    echo "setup: $VENV has ${venv_packages[*]}"
    return
  fi
  echo "setup: installing ${venv_packages[*]} from PyPI into $VENV (a few GB)"
  $PY -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${venv_packages[@]}"
  $PY2 -c 'import torch; print("setup: torch", torch.__version__, "in", torch.__file__)'
}

build() {
  if [[ -n $sanitize ]]; then  # clang; the Python module is not built there
    BUILD_DIR=$build_dir tests/sanitizers/run.sh "$sanitize" build
    return
  fi
  # /usr: the systemd unit names /usr/sbin/gradsyncd and /etc/gradsync/gradsyncd.flags, where
  # `cmake --install` and the packages put them.
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=OFF \
    -DCMAKE_INSTALL_PREFIX=/usr -DPython3_EXECUTABLE=$PY >/dev/null
  cmake --build "$build_dir" -j"$(nproc)"
}

run_tests() {
  local rc=0
  if [[ -n $sanitize ]]; then
    BUILD_DIR=$build_dir tests/sanitizers/run.sh "$sanitize" || rc=$?
    echo "setup: tests/python skipped under the sanitizers (the Python module is not built there)"
    return $rc
  fi
  (cd "$build_dir" && ctest --output-on-failure -j"$(nproc)") || rc=$?
  local py
  for py in $PY $PY2; do  # Debian's torch 1.13, then torch 2.x
    echo "setup: tests/python under $py (torch $($py -c 'import torch; print(torch.__version__)'))"
    GRADSYNC_BUILD_DIR=$PWD/$build_dir $py -m pytest -q tests/python || rc=$?
  done
  return $rc
}

# The Debian packages (CPack, cmake/Packaging.cmake): dpkg-shlibdeps fills in Depends:.
package() {
  if [[ -n $sanitize ]]; then
    echo "setup: no packages from a sanitizer build (GRADSYNC_SANITIZE=$GRADSYNC_SANITIZE)" >&2
    return 2
  fi
  rm -f "$build_dir"/packages/*.deb
  (cd "$build_dir" && cpack --config CPackConfig.cmake >/dev/null)
  echo "setup: packages in $build_dir/packages:"
  ls -1 "$build_dir"/packages/*.deb
}

demo() {
  local dir world=4 rc=0
  dir=$(mktemp -d /tmp/gradsync-demo-XXXXXX)
  local sock=$dir/gradsyncd.sock ctl="$build_dir/client/gradsyncctl --socket=$dir/gradsyncd.sock"
  # One node: no TCP (TCP is for other daemons and needs the cluster token).
  "$build_dir/daemon/gradsyncd" --socket="$sock" --port=-1 --log_sink=stderr 2>"$dir/gradsyncd.log" &
  local daemon=$!
  trap 'kill $daemon 2>/dev/null || true; rm -rf "$dir"' RETURN
  for _ in $(seq 1 200); do $ctl health >/dev/null 2>&1 && break; sleep 0.05; done
  $ctl health
  # The example trainer under torch 2.x's torchrun: 4 ranks, gradients packed and reduced
  # through the daemon.
  GRADSYNC_SOCKET=$sock GRADSYNC_JOB=demo PYTHONPATH=$PWD/$build_dir/python OMP_NUM_THREADS=1 \
    $PY2 -m torch.distributed.run --standalone --nproc_per_node=$world --log_dir "$dir/torchrun" \
    client/python/examples/train.py --steps 40 --param_pack --param_pack_thd 8192 \
    --out "$dir/params{rank}.pt" --hold released &
  local torchrun=$!
  # While the trainers stay attached (they wait for 'released'): what an operator sees.
  local done=0
  for _ in $(seq 1 1200); do
    done=$($ctl --job=demo --timeout=1s store get done 2>/dev/null || echo 0)
    [[ $done == "$world" ]] && break
    kill -0 $torchrun 2>/dev/null || break
    sleep 0.1
  done
  $ctl sessions demo || rc=1
  $ctl --job=demo packlist show world || rc=1
  $ctl --job=demo store set released 1 || rc=1
  wait $torchrun || rc=1
  echo "after the trainers left (the job's state is gone with it):"
  $ctl jobs || rc=1
  # Every rank ends with the same parameters.
  $PY2 -c 'import sys, torch
p = [torch.load(f"{sys.argv[1]}/params{r}.pt") for r in range(int(sys.argv[2]))]
same = all(all(torch.equal(a, b) for a, b in zip(p[0], q)) for q in p[1:])
print(f"parameters identical on all {len(p)} ranks: {same}")
sys.exit(0 if same else 1)' "$dir" $world || rc=1
  kill -TERM $daemon
  wait $daemon || rc=1
  echo "--- gradsyncd log (last 15 lines) ---"
  tail -n 15 "$dir/gradsyncd.log"
  if ((rc == 0)); then echo "demo: OK"; else echo "demo: FAILED"; fi
  return $rc
}

case ${1:-install} in
  install) install_packages && install_venv ;;
  build) install_packages && build ;;
  test) install_packages && install_venv && build && run_tests ;;
  demo) install_packages && install_venv && build && demo ;;
  package) install_packages && build && package ;;
  bench) install_packages && install_venv && build &&
    $PY2 bench/collective_bench.py --build "$build_dir" &&
    $PY2 bench/store_bench.py --build "$build_dir" && $PY2 bench/train_bench.py --build "$build_dir" ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
