#!/usr/bin/env bash
# The Slurm prolog and epilog (deploy/slurm) as slurmd runs them (root, Slurm's prolog
# environment), against a real gradsyncd ($GRADSYNCD, else build/daemon/gradsyncd; gradsyncctl
# likewise), without Slurm:
#   1. job mode: the prolog starts a daemon for the job as the daemon's user (here nobody:nogroup),
#      exits 0 once it serves; health as a member of the group; a trainer under Slurm's variables
#      (gradsync.init(): the job id slurm-<job>.<step>) runs a barrier through it; the epilog
#      stops it (SIGTERM, exit 0 in its log), the pid file and socket gone;
#   2. job mode, a daemon that does not stop (SIGSTOPped): the epilog's bounded wait, SIGKILL, the
#      log line saying so, everything cleaned;
#   3. systemd mode: the prolog only waits for a daemon it did not start (one the test starts,
#      as the unit would), and fails, saying why, within GRADSYNC_WAIT when none serves; the
#      epilog leaves the daemon alone.
# Every wait is bounded; the daemons and folders are removed whatever happens. Needs root (the
# prolog runs the daemon as another user). Exit 77 with the reason where it cannot run.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
build_dir=${BUILD_DIR:-build}
start=$SECONDS
daemon=${GRADSYNCD:-$PWD/$build_dir/daemon/gradsyncd}
ctl=${GRADSYNCCTL:-$PWD/$build_dir/client/gradsyncctl}
prolog=$PWD/deploy/slurm/gradsync-prolog.sh
epilog=$PWD/deploy/slurm/gradsync-epilog.sh

skip() { echo "SKIP: slurm_test: $*"; exit 77; }
fail() { echo "FAIL: slurm_test: $*" >&2; exit 1; }
step() { echo "--- slurm_test: $*"; }
ok() { echo "ok: $*"; }

[[ $(id -u) -eq 0 ]] || skip "needs root (the prolog runs the daemon as another user)"
[[ -x $daemon && -x $ctl ]] || skip "no $daemon or $ctl (./setup.sh build, or set GRADSYNCD and GRADSYNCCTL)"
command -v setpriv >/dev/null || skip "setpriv missing"
user=nobody
group=nogroup
if ! getent passwd $user >/dev/null || ! getent group $group >/dev/null; then
  skip "no user $user or group $group"
fi

work=$(mktemp -d /tmp/gradsync-slurm-test-XXXXXX)
chmod 0755 "$work"
pids=()
cleanup() {
  local rc=$? p
  for p in "${pids[@]}"; do
    kill -CONT "$p" 2>/dev/null || true
    kill -KILL "$p" 2>/dev/null || true
  done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

run_dir=$work/run/gradsync
socket=$run_dir/gradsyncd.sock
flagfile=$work/gradsyncd.flags
printf '%s\n' '# one node: no TCP' '--port=-1' '--log_level=info' >"$flagfile"
# What slurmd gives a prolog and an epilog (slurm.conf Prolog=/Epilog=), and the settings.
slurm_env=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
  SLURM_JOB_USER="$user" SLURM_JOB_UID="$(id -u $user)" SLURM_JOB_GID="$(id -g $user)"
  SLURM_JOB_NODELIST="$(hostname)" SLURMD_NODENAME="$(hostname)" SLURM_CLUSTER_NAME=test
  SLURM_JOB_PARTITION=batch SLURM_JOB_ACCOUNT=test
  GRADSYNC_SLURM_CONF="$work/none" GRADSYNCD="$daemon" GRADSYNCCTL="$ctl"
  GRADSYNC_FLAGFILE="$flagfile" GRADSYNC_RUN_DIR="$run_dir" GRADSYNC_USER="$user"
  GRADSYNC_GROUP="$group" GRADSYNC_LOG_DIR="$work/log" GRADSYNC_SYSLOG=0 GRADSYNC_WAIT=30)
as_member=(setpriv --reuid="$user" --regid="$group" --init-groups --)

daemon_pid() { read -r pid _ <"$run_dir/gradsyncd.slurm-pid" && echo "$pid"; }
# After a job-mode epilog: the daemon $pid is gone, and so are its socket and pid file.
epilog_cleared() {
  ! kill -0 "$pid" 2>/dev/null || fail "gradsyncd pid $pid still runs after the epilog"
  local f
  for f in "$socket" "$socket.fd" "$run_dir/gradsyncd.slurm-pid"; do
    [[ ! -e $f ]] || fail "$f left after the epilog"
  done
}

step "1. job mode: prolog, a trainer, epilog"
job=4242
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job SLURM_SCRIPT_CONTEXT=prolog_slurmd \
  GRADSYNC_SLURM_MODE=job "$prolog" 2>"$work/prolog.err" ||
  { cat "$work/prolog.err" "$work"/log/* 2>/dev/null; fail "prolog exited non-zero"; }
cat "$work/prolog.err"
pid=$(daemon_pid) || fail "no pid file $run_dir/gradsyncd.slurm-pid"
pids+=("$pid")
[[ $(readlink -f "/proc/$pid/exe") == "$(readlink -f "$daemon")" ]] || fail "pid $pid is not $daemon"
[[ $(stat -c %U "/proc/$pid") == "$user" ]] || fail "the daemon does not run as $user"
ok "prolog: gradsyncd pid $pid as $user"
health=$(timeout 10 "${as_member[@]}" "$ctl" --socket="$socket" --timeout=2s health) ||
  fail "gradsyncctl health as a member of $group: $health"
[[ ${health%%$'\n'*} == "gradsyncd $socket: SERVING" ]] || fail "health: $health"
ok "health (member of $group): ${health%%$'\n'*}"
[[ $(stat -c '%a %U:%G' "$run_dir") == "750 $user:$group" ]] ||
  fail "$run_dir is $(stat -c '%a %U:%G' "$run_dir"), want 750 $user:$group"
# A trainer that srun would start: Slurm's variables alone name its rank, world and job.
out=$(timeout 60 env -i PATH=/usr/bin:/bin PYTHONPATH="$PWD/$build_dir/python" OMP_NUM_THREADS=1 \
  GRADSYNC_SOCKET="$socket" SLURM_JOB_ID=$job SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_NTASKS=1 \
  SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_TASKS_PER_NODE=1 SLURM_JOB_NODELIST="$(hostname)" \
  SLURM_STEP_NODELIST="$(hostname)" /usr/bin/python3 -c '
import gradsync
gradsync.init()
job = gradsync._ctx().job
gradsync.barrier()
gradsync.shutdown()
print(job)' 2>&1) || fail "trainer under Slurm's variables: $out"
[[ $out == "slurm-$job.0" ]] || fail "trainer's job id: '$out', want slurm-$job.0"
ok "a trainer under Slurm's variables: job $out, barrier through the job's daemon"
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job SLURM_SCRIPT_CONTEXT=epilog_slurmd \
  GRADSYNC_SLURM_MODE=job "$epilog" 2>"$work/epilog.err" ||
  { cat "$work/epilog.err"; fail "epilog exited non-zero"; }
cat "$work/epilog.err"
epilog_cleared
grep -q 'exiting code=0' "$work/log/job-$job.log" ||
  { cat "$work/log/job-$job.log"; fail "the daemon's log has no 'exiting code=0'"; }
ok "epilog: SIGTERM, the daemon drained and exited 0; socket and pid file gone"

step "2. job mode: a daemon that does not stop"
job=4243
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job GRADSYNC_SLURM_MODE=job "$prolog" \
  2>"$work/prolog.err" || { cat "$work/prolog.err"; fail "prolog exited non-zero"; }
pid=$(daemon_pid) || fail "no pid file"
pids+=("$pid")
kill -STOP "$pid"
t0=$SECONDS
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job GRADSYNC_SLURM_MODE=job GRADSYNC_STOP_WAIT=2 \
  "$epilog" 2>"$work/epilog.err" || { cat "$work/epilog.err"; fail "epilog exited non-zero"; }
cat "$work/epilog.err"
epilog_cleared
grep -q "still running 2s after SIGTERM: SIGKILL" "$work/epilog.err" ||
  fail "the epilog did not say it killed the daemon"
ok "epilog: SIGKILL after GRADSYNC_STOP_WAIT=2 ($((SECONDS - t0)) s), logged; socket and pid file gone"

step "3. systemd mode: the prolog only waits"
job=4244
# No daemon yet: the prolog fails within its wait, saying why.
rc=0
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job GRADSYNC_SLURM_MODE=systemd GRADSYNC_WAIT=2 \
  "$prolog" 2>"$work/prolog.err" || rc=$?
cat "$work/prolog.err"
((rc != 0)) || fail "the prolog succeeded with no daemon"
grep -q "does not answer SERVING" "$work/prolog.err" || fail "the prolog's failure says nothing"
[[ ! -e $run_dir/gradsyncd.slurm-pid ]] || fail "systemd mode started a daemon"
ok "no daemon: the prolog fails (exit $rc) after GRADSYNC_WAIT=2, naming the socket"
# The unit's daemon, started by the test here; the prolog waits for it.
install -d -o $user -g $group -m 0750 "$run_dir"
setpriv --reuid=$user --regid=$group --init-groups -- "$daemon" --socket="$socket" --port=-1 \
  --log_sink=stderr 2>"$work/unit.log" &
unit_pid=$!
pids+=("$unit_pid")
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job GRADSYNC_SLURM_MODE=systemd "$prolog" \
  2>"$work/prolog.err" || { cat "$work/prolog.err" "$work/unit.log"; fail "prolog exited non-zero"; }
cat "$work/prolog.err"
timeout 60 "${slurm_env[@]}" SLURM_JOB_ID=$job GRADSYNC_SLURM_MODE=systemd "$epilog" ||
  fail "epilog exited non-zero"
kill -0 "$unit_pid" 2>/dev/null || fail "the epilog stopped a daemon it did not start"
ok "the prolog waited for the running daemon; the epilog left it running"
kill -TERM "$unit_pid"
unit_rc=0
timeout 30 tail --pid="$unit_pid" -f /dev/null || fail "the daemon still runs 30 s after SIGTERM"
wait "$unit_pid" || unit_rc=$?
((unit_rc == 0)) || fail "the daemon exited $unit_rc on SIGTERM"
echo "slurm_test: OK ($((SECONDS - start)) s)"
