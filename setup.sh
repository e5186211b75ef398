#!/usr/bin/env bash
# Installs every Debian package gradsync needs to build, test and benchmark.
# Idempotent: packages already present are skipped by apt-get. Run as root.
set -euo pipefail

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

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "setup: need root to install: ${missing[*]}" >&2
  exit 1
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
