#!/usr/bin/env bash
# The committed flagfile and configuration page are what the daemon's flag definitions print;
# the manual pages (gradsyncd --print_config=man, gradsyncctl --print_man) are well-formed roff
# that groff renders without a warning, and name every flag.
#   tests/docs/config_docs_test.sh GRADSYNCD SOURCE_DIR GRADSYNCCTL
# Regenerate both: cmake --build build --target config_docs
set -euo pipefail
gradsyncd=$1 src=$2 gradsyncctl=$3
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
elif ! grep -q "flagfile, markdown or man" <<<"$out"; then
  echo "FAIL: --print_config=yaml said: $out"; rc=1
fi
# The manual pages.
man_check() {  # name roff-file flags-source
  local warnings flags missing=()
  if ! warnings=$(timeout 30 groff -man -ww -z "$2" 2>&1) || [[ -n $warnings ]]; then
    echo "FAIL: $1's manual page: groff says: $warnings"; rc=1; return
  fi
  flags=$(grep -oE '^ABSL_FLAG\([^,]+, [a-z_]+' "$3" | sed -E 's/.*, //')
  for f in $flags; do
    grep -qF "\\fB\\-\\-${f}\\fR" "$2" || missing+=("$f")
  done
  if ((${#missing[@]})); then
    echo "FAIL: $1's manual page lacks --${missing[*]}"; rc=1
  else
    echo "ok: $1's manual page renders without warnings and names its $(wc -w <<<"$flags") flags"
  fi
}
if ! command -v groff >/dev/null; then
  echo "FAIL: groff is missing (Debian's groff-base; ./setup.sh installs it)"; rc=1
else
  page=$(mktemp)
  timeout 30 "$gradsyncd" --print_config=man >"$page"
  man_check gradsyncd "$page" "$src/daemon/config.cc"
  timeout 30 "$gradsyncctl" --print_man >"$page"
  man_check gradsyncctl "$page" "$src/client/gradsyncctl.cc"
  rm -f "$page"
fi
exit $rc
