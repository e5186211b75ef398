#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=, or a file in a Prolog directory), run as root on each node of
# a job before its first step. Makes sure the node's gradsyncd serves before the job's trainers
# start:
#   systemd mode (the gradsyncd package's unit on every node, recommended): waits, at most
#     GRADSYNC_WAIT seconds, until it answers SERVING; it never starts or restarts it;
#   job mode (no unit): starts gradsyncd for this job as GRADSYNC_USER with the flagfile, its
#     socket in GRADSYNC_RUN_DIR, its log in GRADSYNC_LOG_DIR/job-<id>.log, then waits the same
#     way. A daemon already serving the socket is used as it is (and left to whoever started it).
# Exit 0: the daemon serves. Otherwise a non-zero exit, and Slurm drains the node and requeues
# the job: the reason is in slurmd's log (and syslog). Settings: gradsync-slurm.sh.
set -euo pipefail
# shellcheck disable=SC2034  # gradsync-slurm.sh logs it
script_name=gradsync-prolog
# shellcheck source-path=SCRIPTDIR source=gradsync-slurm.sh
source "$(dirname "$(readlink -f "$0")")/gradsync-slurm.sh"

[[ -n $job ]] || { log "SLURM_JOB_ID is not set: not run by slurmd?"; exit 1; }
m=$(mode)
[[ -x $GRADSYNCCTL ]] || { log "$GRADSYNCCTL missing (the gradsyncd package installs it)"; exit 1; }

wait_serving() {  # pid (optional) must stay alive meanwhile
  local pid=${1:-} deadline=$((SECONDS + GRADSYNC_WAIT))
  while ((SECONDS < deadline)); do
    serving && return 0
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    sleep 0.2
  done
  serving
}

if [[ $m == systemd ]]; then
  if wait_serving; then
    log "mode=systemd: gradsyncd serves $socket"
    exit 0
  fi
  log "mode=systemd: gradsyncd does not answer SERVING on $socket after ${GRADSYNC_WAIT}s" \
    "(systemctl status gradsyncd; journalctl -u gradsyncd)"
  exit 1
fi

if serving; then
  log "mode=job: a gradsyncd already serves $socket; using it (not started for this job)"
  exit 0
fi
[[ -x $GRADSYNCD ]] || { log "$GRADSYNCD missing"; exit 1; }
[[ -f $GRADSYNC_FLAGFILE ]] || { log "flagfile $GRADSYNC_FLAGFILE missing"; exit 1; }
getent passwd "$GRADSYNC_USER" >/dev/null || { log "no user $GRADSYNC_USER"; exit 1; }
getent group "$GRADSYNC_GROUP" >/dev/null || { log "no group $GRADSYNC_GROUP"; exit 1; }
if [[ -f $pid_file ]]; then
  read -r old_pid old_job <"$pid_file" || true
  if [[ -n ${old_pid:-} ]] && kill -0 "$old_pid" 2>/dev/null; then
    log "mode=job: gradsyncd pid $old_pid of job ${old_job:-?} runs but does not serve $socket;" \
      "its epilog did not stop it"
    exit 1
  fi
  rm -f "$pid_file"
fi
# As systemd makes the unit's RuntimeDirectory: the daemon's, mode 0750; trainer users reach the
# socket (0660, group $GRADSYNC_GROUP) as members of the group.
install -d -o "$GRADSYNC_USER" -g "$GRADSYNC_GROUP" -m 0750 "$GRADSYNC_RUN_DIR"
install -d -m 0755 "$GRADSYNC_LOG_DIR"
daemon_log=$GRADSYNC_LOG_DIR/job-$job.log
: >"$daemon_log"
chown "$GRADSYNC_USER:$GRADSYNC_GROUP" "$daemon_log"
chmod 0640 "$daemon_log"
if [[ -n ${SLURM_JOB_USER:-} ]] && ! id -nG "$SLURM_JOB_USER" 2>/dev/null | tr ' ' '\n' |
  grep -qx "$GRADSYNC_GROUP"; then
  log "warning: job user $SLURM_JOB_USER is not in group $GRADSYNC_GROUP: its trainers cannot" \
    "open $socket (usermod -aG $GRADSYNC_GROUP $SLURM_JOB_USER)"
fi
# Its own session, out of the prolog's: it outlives the prolog until the epilog stops it.
(
  umask 0007
  exec setsid env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    setpriv --reuid="$GRADSYNC_USER" --regid="$GRADSYNC_GROUP" --init-groups -- \
    "$GRADSYNCD" --flagfile="$GRADSYNC_FLAGFILE" --socket="$socket" --log_sink=stderr \
    </dev/null >>"$daemon_log" 2>&1
) &
pid=$!
echo "$pid $job" >"$pid_file"
if wait_serving "$pid"; then
  log "mode=job: gradsyncd pid $pid serves $socket (log $daemon_log)"
  exit 0
fi
log "mode=job: gradsyncd pid $pid did not answer SERVING on $socket in ${GRADSYNC_WAIT}s;" \
  "its log ($daemon_log) ends:"
tail -n 5 "$daemon_log" | sed 's/^/  /' >&2
kill -KILL "$pid" 2>/dev/null || true
rm -f "$pid_file"
exit 1
