#!/usr/bin/env bash
# systemd-analyze verify on the generated unit, pointed at the build's binary and the repo's
# flagfile (verify checks that ExecStart exists). Exit 77 (skip) where systemd-analyze is absent.
set -euo pipefail
unit=$1 daemon=$2 deploy_dir=$3
command -v systemd-analyze >/dev/null || { echo "SKIP: systemd-analyze not installed"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed -e "s|^ExecStart=[^ ]*|ExecStart=$daemon|" \
    -e "s|--flagfile=[^ ]*|--flagfile=$deploy_dir/gradsyncd.flags|" "$unit" > "$work/gradsyncd.service"
grep -q '^Type=notify$' "$work/gradsyncd.service"
grep -q '^WatchdogSec=' "$work/gradsyncd.service"
grep -q '^RuntimeDirectory=gradsync$' "$work/gradsyncd.service"
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no "$work/gradsyncd.service" 2>&1) || {
  echo "$out"; exit 1; }
# verify reports unit-file problems as log lines while still exiting 0 for some of them.
if grep -E "gradsyncd.service" <<<"$out" | grep -Eiv "^$" ; then
  echo "systemd-analyze verify reported the lines above"; exit 1
fi
echo "systemd-analyze verify: clean ($work/gradsyncd.service -> $daemon)"
