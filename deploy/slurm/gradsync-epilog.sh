#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=), run as root on each node of a job after it ends. Job mode:
# stops the gradsyncd that gradsync-prolog.sh started for this job (its pid file names the job):
# SIGTERM (it drains, then exits 0), at most GRADSYNC_STOP_WAIT seconds, then SIGKILL with a log
# line; removes the pid file and a socket a killed daemon leaves. systemd mode, or a daemon this
# job's prolog did not start: nothing to do. Exit 0 unless the daemon survives SIGKILL (Slurm then
# drains the node). Settings: gradsync-slurm.sh.
set -euo pipefail
# shellcheck disable=SC2034  # gradsync-slurm.sh logs it
script_name=gradsync-epilog
# shellcheck source-path=SCRIPTDIR source=gradsync-slurm.sh
source "$(dirname "$(readlink -f "$0")")/gradsync-slurm.sh"

[[ -n $job ]] || { log "SLURM_JOB_ID is not set: not run by slurmd?"; exit 1; }
m=$(mode)
if [[ $m == systemd ]]; then
  exit 0
fi
[[ -f $pid_file ]] || exit 0  # no daemon of this job's prolog on this node
read -r pid pid_job <"$pid_file" || true
if [[ ${pid_job:-} != "$job" ]]; then
  log "mode=job: $pid_file names job ${pid_job:-?}, not this one: left alone"
  exit 0
fi
# The pid is the daemon's only while it runs $GRADSYNCD (not a pid reused since).
if [[ -n ${pid:-} ]] && kill -0 "$pid" 2>/dev/null &&
  [[ $(readlink -f "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "$GRADSYNCD")" ]]; then
  kill -TERM "$pid"
  deadline=$((SECONDS + GRADSYNC_STOP_WAIT))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    log "mode=job: gradsyncd pid $pid still running ${GRADSYNC_STOP_WAIT}s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "mode=job: gradsyncd pid $pid survives SIGKILL"
      exit 1
    fi
  else
    log "mode=job: gradsyncd pid $pid stopped"
  fi
fi
# A daemon that drained removed its socket; a killed one leaves it (and the fd channel's).
rm -f "$pid_file" "$socket" "$socket.fd"
exit 0
