#!/usr/bin/env bash
# The Debian packages as an operator installs them: builds them (./setup.sh package, into
# build/packages/), then on this machine
#   1. lintian: no errors on any of the four;
#   2. `cmake --install` of the same build into a scratch DESTDIR installs every absolute path
#      the unit names, and every file the packages hold;
#   3. apt-get install of gradsyncd, libgradsync-c0, libgradsync-dev and python3-gradsync: the
#      C library under its SONAME (libgradsync_c.so.0, its shlibs file), the gradsync user,
#      the unit enabled, the flagfile and the environment file conffiles, systemd-analyze
#      verify of the installed unit as it is; where systemd is PID 1, the unit active and SERVING;
#   4. the installed unit's ExecStart run as its User and Group in its RuntimeDirectory, as
#      systemd would: SERVING, gradsyncctl health and jobs (as a member of the gradsync group;
#      refused to others), a C program built with `pkg-config gradsync` (linked to the SONAME)
#      and Python's `import
#      gradsync` (no PYTHONPATH) each running an op through it, SIGTERM exits 0;
#   5. apt-get purge: no file or directory of the packages left, no /etc/gradsync, no unit link.
# Every wait is bounded; whatever happens, the packages are purged and the daemon stopped.
# Needs root; installs and purges the four packages (refuses, exit 77, where one of them is
# already installed). Exit 77 with the reason where it cannot run.
#   tests/deploy/package_test.sh                              build the packages, then test
#   GRADSYNC_PACKAGES_BUILT=1 tests/deploy/package_test.sh    test build/packages/ as it is
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
build_dir=${BUILD_DIR:-build}
packages=(gradsyncd libgradsync-c0 libgradsync-dev python3-gradsync)
export DEBIAN_FRONTEND=noninteractive
# What systemd gives a service, and what the test's own commands see.
clean_env=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "--- package_test: $*"; }
ok() { echo "ok: $*"; }

[[ $(id -u) -eq 0 ]] || skip "needs root: it installs and purges packages"
command -v dpkg-query >/dev/null && command -v apt-get >/dev/null || skip "dpkg or apt-get missing"
for p in "${packages[@]}"; do
  state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ -z $state || $state == not-installed ]] ||
    skip "$p is $state on this machine; the test would purge it (apt-get purge ${packages[*]})"
done
[[ ! -e /etc/gradsync ]] ||
  skip "/etc/gradsync exists (not from the packages); purge is expected to leave none"

if [[ ${GRADSYNC_PACKAGES_BUILT:-0} != 1 ]]; then
  step "./setup.sh package"
  ./setup.sh package
fi
for tool in setpriv cc pkg-config lintian objdump; do
  command -v $tool >/dev/null || skip "$tool missing (./setup.sh installs it)"
done
debs=()
for p in "${packages[@]}"; do
  found=("$PWD/$build_dir"/packages/"${p}"_*.deb)
  [[ ${#found[@]} -eq 1 && -f ${found[0]} ]] ||
    fail "want one $build_dir/packages/${p}_*.deb, found: ${found[*]}"
  debs+=("${found[0]}")
done

work=$(mktemp -d /tmp/gradsync-package-test-XXXXXX)
daemon_pid=
installed=0
cleanup() {
  local rc=$?
  if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  if ((installed)); then
    timeout 120 apt-get purge -y -qq "${packages[@]}" >"$work/cleanup-purge.log" 2>&1 ||
      { echo "cleanup: apt-get purge failed:"; cat "$work/cleanup-purge.log"; } >&2
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# The unit's value of `key` (the first such line).
unit_value() { sed -n "s/^$2=//p" "$1" | head -n 1; }

step "1. lintian"
lintian_rc=0
timeout 300 lintian --tag-display-limit 0 "${debs[@]}" >"$work/lintian.txt" 2>&1 || lintian_rc=$?
cat "$work/lintian.txt"
if grep -q '^E: ' "$work/lintian.txt"; then
  fail "lintian reports errors (E: lines above)"
elif ((lintian_rc != 0)); then
  fail "lintian exited $lintian_rc"
fi
ok "lintian: no errors ($(grep -c '^W: ' "$work/lintian.txt" || true) warnings)"

step "2. cmake --install into a DESTDIR"
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build_dir/CMakeCache.txt")
[[ $prefix == /usr ]] ||
  fail "$build_dir is configured with CMAKE_INSTALL_PREFIX=$prefix; the unit's paths hold for /usr"
dest=$work/destdir
DESTDIR=$dest timeout 120 cmake --install "$build_dir" --prefix /usr >"$work/install.log" 2>&1 ||
  { cat "$work/install.log"; fail "cmake --install --prefix /usr"; }
dest_unit=$(find "$dest" -path '*/systemd/system/gradsyncd.service' | head -n 1)
[[ -n $dest_unit ]] || fail "cmake --install installed no gradsyncd.service"
read -ra dest_argv <<<"$(unit_value "$dest_unit" ExecStart)"
named=()
for a in "${dest_argv[@]}"; do
  [[ $a == /* ]] && named+=("$a")
  [[ $a == --*=/* ]] && named+=("${a#*=}")
done
((${#named[@]} >= 2)) || fail "ExecStart=${dest_argv[*]} names no daemon and flagfile"
for p in "${named[@]}"; do
  [[ -e $dest$p ]] || fail "the unit names $p, which cmake --install does not install (it put:" \
    "$(cd "$dest" && find . -name "$(basename "$p")" | sed 's|^\.||' | tr '\n' ' '))"
  ok "the unit names $p; cmake --install puts it there"
done

step "3. apt-get install ${debs[*]##*/}"
installed=1
timeout 300 apt-get install -y -qq --no-install-recommends "${debs[@]}" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; fail "apt-get install"; }
grep -i "warning\|error" "$work/apt.log" || true
for p in "${packages[@]}"; do
  dpkg-query -L "$p" | sed '/^\/\.$/d' >"$work/$p.files"
  ok "$p $(dpkg-query -W -f='${Version}' "$p") installed: $(wc -l <"$work/$p.files") paths"
done
unit=$(grep -E '/systemd/system/gradsyncd\.service$' "$work/gradsyncd.files") ||
  fail "gradsyncd ships no unit"
cmp "$unit" "$dest_unit" || fail "the package's $unit differs from cmake --install's"
# The packages hold what cmake --install installs (the docs aside: packages only).
while read -r f; do
  [[ $f == /usr/share/doc/* || -d $f ]] && continue
  [[ -e $dest$f ]] || fail "$f is in a package but not installed by cmake --install"
done < <(cat "$work"/*.files)
ok "the packages' files are the ones cmake --install installs"
conffiles=(/etc/gradsync/gradsyncd.flags /etc/gradsync/gradsyncd.env)
for f in /usr/sbin/gradsyncd /usr/bin/gradsyncctl "${conffiles[@]}"; do
  grep -qx "$f" "$work/gradsyncd.files" || fail "gradsyncd does not ship $f"
done
for f in "${conffiles[@]}"; do
  dpkg-query -W -f='${Conffiles}\n' gradsyncd | grep -q " $f " || fail "$f is not a conffile"
  ok "$f is a conffile"
done
user=$(unit_value "$unit" User)
group=$(unit_value "$unit" Group)
getent passwd "$user" >/dev/null || fail "no user $user after installation"
getent group "$group" >/dev/null || fail "no group $group after installation"
ok "user $user, group $group"
wants=/etc/systemd/system/multi-user.target.wants/gradsyncd.service
[[ -L $wants && $(readlink -f "$wants") == "$(readlink -f "$unit")" ]] ||
  fail "the unit is not enabled ($wants: $(ls -l "$wants" 2>&1))"
ok "enabled: $wants -> $(readlink "$wants")"
if command -v systemd-analyze >/dev/null; then
  out=$(SYSTEMD_LOG_LEVEL=notice timeout 60 systemd-analyze verify --man=no "$unit" 2>&1) ||
    { echo "$out"; fail "systemd-analyze verify $unit"; }
  ! grep "gradsyncd.service" <<<"$out" || fail "systemd-analyze verify reported the lines above"
  ok "systemd-analyze verify $unit (as installed): clean"
else
  echo "systemd-analyze missing: the installed unit is not verified"
fi

# gradsyncctl against the daemon at its default socket (the flagfile's) until SERVING or
# `seconds` pass; `pid` (optional) must stay alive meanwhile.
wait_serving() {
  local seconds=$1 pid=${2:-} deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    "${clean_env[@]}" timeout 5 gradsyncctl --timeout=1s health 2>/dev/null |
      grep -q ': SERVING$' && return 0
    sleep 0.2
  done
  return 1
}

if [[ -d /run/systemd/system ]]; then
  step "3b. systemd: the unit started by the package"
  deadline=$((SECONDS + 30))
  until systemctl is-active --quiet gradsyncd.service; do
    ((SECONDS < deadline)) ||
      { systemctl status --no-pager gradsyncd.service || true; fail "gradsyncd not active"; }
    sleep 0.5
  done
  systemctl is-enabled --quiet gradsyncd.service || fail "gradsyncd.service not enabled"
  wait_serving 30 || fail "gradsyncd.service active but not SERVING"
  ok "gradsyncd.service active, enabled, SERVING"
  # The step below runs the same command line by hand, on the same socket.
  timeout 60 systemctl stop gradsyncd.service
else
  echo "--- package_test: 3b skipped: systemd is not PID 1 here ($(cat /proc/1/comm)), so the" \
    "package could enable the unit but not start it; step 4 runs its ExecStart by hand"
fi

step "4. the installed unit's ExecStart, as its User, in its RuntimeDirectory"
exec_start=$(unit_value "$unit" ExecStart)
[[ $exec_start != *[\"\'\\%\$]* ]] ||
  fail "ExecStart=$exec_start has quoting or specifiers this test does not expand"
read -ra argv <<<"$exec_start"
runtime_dir=/run/$(unit_value "$unit" RuntimeDirectory)
runtime_mode=$(unit_value "$unit" RuntimeDirectoryMode)
umask_value=$(unit_value "$unit" UMask)
[[ $runtime_dir != /run/ ]] || fail "the unit has no RuntimeDirectory="
install -d -o "$user" -g "$group" -m "${runtime_mode:-0755}" "$runtime_dir"
extra=()
# The unit logs to the journal (--log_sink=journal). Without journald (no systemd as PID 1) those
# lines would be lost, so there, and only there, the daemon gets --log_sink=stderr (the last
# value of a flag wins) and its log shows in a failure. Nothing else differs from the unit.
[[ -S /run/systemd/journal/socket ]] || extra=(--log_sink=stderr)
# The unit's EnvironmentFile= as installed sets nothing (comments only): no variable to pass.
env_file=$(unit_value "$unit" EnvironmentFile)
env_file=${env_file#-}
[[ -f $env_file ]] || fail "the unit's EnvironmentFile=$env_file is not installed"
! grep -Ev '^[[:space:]]*(#|$)' "$env_file" || fail "$env_file as installed sets variables (above)"
echo "running as $user:$group: ${argv[*]} ${extra[*]}"
(
  umask "${umask_value:-0022}"
  exec "${clean_env[@]}" setpriv --reuid="$user" --regid="$group" --init-groups -- \
    "${argv[@]}" "${extra[@]}"
) >"$work/gradsyncd.log" 2>&1 &
daemon_pid=$!
wait_serving 30 "$daemon_pid" ||
  { cat "$work/gradsyncd.log"; fail "the unit's ExecStart did not reach SERVING in 30 s"; }
ok "SERVING"
socket=$runtime_dir/gradsyncd.sock
ok "socket: $(stat -c '%n %A %U:%G' "$socket")"
gid=$(getent group "$group" | cut -d: -f3)
# Trainers and operators reach the daemon as members of its group.
as_member=("${clean_env[@]}" setpriv --reuid=nobody --regid=nogroup --groups="$gid" --)
as_other=("${clean_env[@]}" setpriv --reuid=nobody --regid=nogroup --clear-groups --)
health=$("${as_member[@]}" timeout 10 gradsyncctl --timeout=5s health) ||
  fail "gradsyncctl health as a member of $group: $health"
# The first line the status; the second whether the daemon's GPU kernels can overlap (MPS).
[[ ${health%%$'\n'*} == "gradsyncd $socket: SERVING" ]] || fail "gradsyncctl health: '$health'"
[[ $health == *$'\n'"gpu: mps="@(on|off|unavailable)" reason="* ]] ||
  fail "gradsyncctl health has no MPS line: '$health'"
ok "gradsyncctl health (member of $group): $health"
jobs=$("${as_member[@]}" timeout 10 gradsyncctl --timeout=5s jobs) ||
  fail "gradsyncctl jobs: $jobs"
ok "gradsyncctl jobs: ${jobs:-(none)}"
if "${as_other[@]}" timeout 10 gradsyncctl --timeout=2s health >/dev/null 2>&1; then
  fail "a user outside $group reached the daemon's socket"
fi
ok "refused to a user outside $group"

# The C ABI as libgradsync-dev ships it: a one-rank job's all-reduce and store through the daemon.
cat >"$work/c_client.c" <<'EOF'
#include <gradsync.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  gs_client* c = NULL;
  gs_buffer* b = NULL;
  if (gs_connect_ex("/run/gradsync/gradsyncd.sock", "package-test-c", 1, 0, 0, 1, NULL, &c) != 0 ||
      gs_buffer_create(c, 2 * sizeof(float), GS_FLOAT32, &b) != 0) {
    fprintf(stderr, "connect: %s\n", gs_last_error());
    return 1;
  }
  float* v = (float*)gs_buffer_data(b);
  v[0] = 1.5f;
  v[1] = -2.0f;
  gs_segment s = {gs_buffer_id(b), 0, 2};
  if (gs_all_reduce(c, GS_FLOAT32, GS_SUM, &s, 1, NULL) != 0 || v[0] != 1.5f || v[1] != -2.0f) {
    fprintf(stderr, "all_reduce: %s (%g %g)\n", gs_last_error(), v[0], v[1]);
    return 1;
  }
  void* got = NULL;
  size_t n = 0;
  if (gs_store_set(c, "k", "v1", 2) != 0 || gs_store_get(c, "k", 1000, &got, &n) != 0 ||
      n != 2 || memcmp(got, "v1", 2) != 0) {
    fprintf(stderr, "store: %s\n", gs_last_error());
    return 1;
  }
  gs_free(got);
  gs_buffer_deregister(c, b);
  gs_buffer_free(b);
  gs_close(c);
  printf("c client: all_reduce and store OK\n");
  return 0;
}
EOF
read -ra pc_flags <<<"$(pkg-config --cflags --libs gradsync)"
cc -Wall -Werror -o "$work/c_client" "$work/c_client.c" "${pc_flags[@]}" ||
  fail "cc with pkg-config --cflags --libs gradsync (${pc_flags[*]})"
chmod 755 "$work" "$work/c_client"
needed=$(objdump -p "$work/c_client" | awk '$1 == "NEEDED" && $2 ~ /gradsync/ {print $2}')
[[ $needed == libgradsync_c.so.0 ]] || fail "the C client needs '$needed', not the SONAME libgradsync_c.so.0"
soname=$(objdump -p "$(readlink -f /usr/lib/*/libgradsync_c.so.0)" | awk '$1 == "SONAME" {print $2}')
[[ $soname == libgradsync_c.so.0 ]] || fail "libgradsync_c.so.0's SONAME is '$soname'"
grep -q '^libgradsync_c 0 libgradsync-c0 (>= ' /var/lib/dpkg/info/libgradsync-c0*.shlibs ||
  fail "libgradsync-c0's shlibs file: $(cat /var/lib/dpkg/info/libgradsync-c0*.shlibs 2>&1)"
"${as_member[@]}" timeout 30 "$work/c_client" || fail "the C client against the daemon"
ok "C: built with pkg-config gradsync (${pc_flags[*]}), ran as a member of $group"

# The Python package as python3-gradsync installs it: Debian's interpreter, no PYTHONPATH.
"${as_member[@]}" timeout 60 /usr/bin/python3 -c '
import array, gradsync
assert gradsync.__file__ == "/usr/lib/python3/dist-packages/gradsync/__init__.py", gradsync.__file__
gradsync.init(job="package-test-py", rank=0, world_size=1)
gradsync.barrier()
gradsync.shutdown()
print("python client: import from", gradsync.__file__, "and barrier OK")
' || fail "python3 -c 'import gradsync' and a barrier"
ok "Python: import gradsync from /usr/lib/python3/dist-packages, an op through the daemon"

kill -TERM "$daemon_pid"
deadline=$((SECONDS + 30))  # the unit's TimeoutStopSec
while kill -0 "$daemon_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
if kill -0 "$daemon_pid" 2>/dev/null; then
  cat "$work/gradsyncd.log"
  fail "gradsyncd still running 30 s after SIGTERM"
fi
daemon_rc=0
wait "$daemon_pid" || daemon_rc=$?
daemon_pid=
((daemon_rc == 0)) || { cat "$work/gradsyncd.log"; fail "gradsyncd exited $daemon_rc on SIGTERM"; }
ok "SIGTERM: exit 0"
echo "gradsyncd log (last 5 lines):"
tail -n 5 "$work/gradsyncd.log"

step "5. apt-get purge ${packages[*]}"
timeout 300 apt-get purge -y -qq "${packages[@]}" >"$work/purge.log" 2>&1 ||
  { cat "$work/purge.log"; fail "apt-get purge"; }
installed=0
grep -E "^(Removing|Purging)|warning|error" "$work/purge.log" || true
for p in "${packages[@]}"; do
  state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ -z $state || $state == not-installed ]] || fail "$p is $state after purge"
done
left=()
while read -r f; do
  [[ -e $f || -L $f ]] || continue
  # A directory that stays because other packages own it too (/usr/share/doc, /lib/systemd/system;
  # /lib, a link to usr/lib on a merged /usr).
  [[ -d $f ]] && dpkg-query -S "$f" >/dev/null 2>&1 && continue
  left+=("$f")
done < <(cat "$work"/*.files)
((${#left[@]} == 0)) || fail "left after purge: ${left[*]}"
ok "nothing of the packages' $(cat "$work"/*.files | wc -l) paths left"
for d in /etc/gradsync "$runtime_dir" /usr/lib/python3/dist-packages/gradsync; do
  [[ ! -e $d ]] || fail "$d left after purge: $(ls -la "$d")"
done
links=$(find /etc/systemd /var/lib/systemd/deb-systemd-helper-enabled \
  /var/lib/systemd/deb-systemd-helper-masked -name '*gradsyncd*' 2>/dev/null || true)
[[ -z $links ]] || fail "unit links or state left after purge: $links"
ok "no /etc/gradsync, no $runtime_dir, no unit link"
if getent passwd "$user" >/dev/null; then
  echo "note: the $user user and group stay after purge (Debian keeps system users)"
fi
echo "package_test: OK"
