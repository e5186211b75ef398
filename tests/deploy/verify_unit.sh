#!/usr/bin/env bash
# The systemd unit as `cmake --install` lays it out: installs the daemon's component of a build
# into a scratch DESTDIR, checks that every absolute path the unit names (the daemon, its
# flagfile, the environment file next to the flagfile, which sets nothing as installed) is
# installed exactly there and that the unit lets NCCL open the InfiniBand/RoCE verbs devices,
# then runs systemd-analyze verify on the installed unit, its ExecStart pointed into the DESTDIR
# (verify checks that the program exists; nothing else is changed).
# tests/deploy/package_test.sh verifies the unit the package installs, unmodified.
#   verify_unit.sh <build dir>
# Exit 77 (skip) where systemd-analyze is absent.
set -euo pipefail
build=$1
command -v systemd-analyze >/dev/null || { echo "SKIP: systemd-analyze not installed"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dest=$work/root
DESTDIR=$dest cmake --install "$build" --component daemon >"$work/install.log" 2>&1 || {
  cat "$work/install.log"; echo "FAIL: cmake --install --component daemon"; exit 1; }
units=("$dest"/{lib,usr/lib,usr/local/lib}/systemd/system/gradsyncd.service)
unit=
for u in "${units[@]}"; do [[ -f $u ]] && unit=$u; done
[[ -n $unit ]] || { echo "FAIL: no gradsyncd.service installed under $dest"; find "$dest"; exit 1; }
echo "installed unit: ${unit#"$dest"}"

grep -q '^Type=notify$' "$unit"
grep -q '^WatchdogSec=' "$unit"
grep -q '^RuntimeDirectory=gradsync$' "$unit"
grep -qx 'DeviceAllow=char-infiniband_verbs rw' "$unit" || {
  echo "FAIL: no 'DeviceAllow=char-infiniband_verbs rw': NCCL could not use InfiniBand/RoCE"
  exit 1
}
echo "ok: the unit allows the InfiniBand/RoCE verbs devices (char-infiniband_verbs)"
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
read -ra argv <<<"$exec_start"
# Every absolute path of the command line, alone or as a flag's value.
paths=()
for a in "${argv[@]}"; do
  v=${a#*=}
  [[ $a == /* ]] && paths+=("$a")
  [[ $a == --*=/* ]] && paths+=("$v")
done
((${#paths[@]} >= 2)) || { echo "FAIL: ExecStart=$exec_start: no daemon and flagfile"; exit 1; }
# NCCL's environment: optional ('-'), next to the flagfile.
flagfile=
for a in "${argv[@]}"; do [[ $a == --flagfile=* ]] && flagfile=${a#--flagfile=}; done
env_file=${flagfile%/*}/gradsyncd.env
env_line=$(grep '^EnvironmentFile=' "$unit" || true)
[[ -n $flagfile && $env_line == "EnvironmentFile=-$env_file" ]] || {
  echo "FAIL: want EnvironmentFile=-$env_file (next to --flagfile=$flagfile), the unit has:" \
    "${env_line:-none}"; exit 1; }
paths+=("$env_file")
rc=0
for p in "${paths[@]}"; do
  if [[ -e $dest$p ]]; then
    echo "ok: the unit names $p, installed there"
  else
    echo "FAIL: the unit names $p, which cmake --install does not install (installed:" \
      "$(cd "$dest" && find . -name "$(basename "$p")" | sed 's|^\.||' | tr '\n' ' '))"
    rc=1
  fi
done
((rc == 0)) || exit 1
# As installed it only shows examples: it must not change the daemon's environment.
if set_vars=$(grep -Ev '^[[:space:]]*(#|$)' "$dest$env_file"); then
  echo "FAIL: $env_file as installed sets variables:"; echo "$set_vars"; exit 1
fi
echo "ok: $env_file as installed sets nothing"

sed -e "s|^ExecStart=${argv[0]}|ExecStart=$dest${argv[0]}|" "$unit" >"$work/gradsyncd.service"
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no "$work/gradsyncd.service" 2>&1) || {
  echo "$out"; exit 1; }
# verify reports unit-file problems as log lines while still exiting 0 for some of them.
if grep -E "gradsyncd.service" <<<"$out" | grep -Eiv "^$"; then
  echo "systemd-analyze verify reported the lines above"; exit 1
fi
echo "systemd-analyze verify: clean (${unit#"$dest"})"
