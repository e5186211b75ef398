#!/usr/bin/env bash
# The committed flagfile and configuration page are what the daemon's flag definitions print.
#   tests/docs/config_docs_test.sh GRADSYNCD SOURCE_DIR
# Regenerate both: cmake --build build --target config_docs
set -euo pipefail
gradsyncd=$1 src=$2
rc=0
check() {  # what file
  local got
  got=$(mktemp)
  if ! timeout 30 "$gradsyncd" --print_config="$1" >"$got"; then
    echo "FAIL: gradsyncd --print_config=$1 failed"; rc=1
  elif ! diff -u "$src/$2" "$got"; then
    echo "FAIL: $2 differs from gradsyncd --print_config=$1 (regenerate: cmake --build build --target config_docs)"
    rc=1
  else
    echo "ok: $2 is what gradsyncd --print_config=$1 prints"
  fi
  rm -f "$got"
}
check flagfile deploy/gradsyncd.flags
check markdown docs/configuration.md
# A bad value is refused with a clear message, not a crash.
if out=$(timeout 30 "$gradsyncd" --print_config=yaml 2>&1); then
  echo "FAIL: --print_config=yaml succeeded"; rc=1
elif ! grep -q "flagfile or markdown" <<<"$out"; then
  echo "FAIL: --print_config=yaml said: $out"; rc=1
fi
exit $rc
