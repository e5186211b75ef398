# shellcheck shell=bash disable=SC2034,SC2154  # sourced: the prolog and epilog set and use these
# Shared by gradsync-prolog.sh and gradsync-epilog.sh (sourced; not run by itself): their
# settings, a log function and the health check. Settings come from the environment, else from
# $GRADSYNC_SLURM_CONF (/etc/gradsync/slurm.conf: VAR=value lines, sourced when present), else
# the defaults below.
#
#   GRADSYNC_SLURM_MODE   auto (default): systemd when gradsyncd.service is enabled, else job;
#                         systemd: the package's unit runs the daemon, the prolog only waits for it;
#                         job: the prolog starts a daemon for the job, the epilog stops it
#   GRADSYNCD             the daemon (/usr/sbin/gradsyncd)
#   GRADSYNCCTL           gradsyncctl (/usr/bin/gradsyncctl)
#   GRADSYNC_FLAGFILE     the daemon's flagfile (/etc/gradsync/gradsyncd.flags: the package's)
#   GRADSYNC_RUN_DIR      the socket's folder (/run/gradsync): the socket is gradsyncd.sock in it
#   GRADSYNC_USER, GRADSYNC_GROUP   the daemon's user and group (gradsync, gradsync)
#   GRADSYNC_LOG_DIR      job mode: the daemon's log, job-<id>.log (/var/log/gradsync)
#   GRADSYNC_WAIT         seconds the prolog waits for SERVING (60)
#   GRADSYNC_STOP_WAIT    seconds the epilog waits after SIGTERM before SIGKILL (30)
#   GRADSYNC_SYSLOG       1: log lines also to syslog (logger -t gradsync-slurm); default 1
#                         where /dev/log exists
conf=${GRADSYNC_SLURM_CONF:-/etc/gradsync/slurm.conf}
if [[ -f $conf ]]; then
  # shellcheck source=/dev/null
  source "$conf"
fi
GRADSYNC_SLURM_MODE=${GRADSYNC_SLURM_MODE:-auto}
GRADSYNCD=${GRADSYNCD:-/usr/sbin/gradsyncd}
GRADSYNCCTL=${GRADSYNCCTL:-/usr/bin/gradsyncctl}
GRADSYNC_FLAGFILE=${GRADSYNC_FLAGFILE:-/etc/gradsync/gradsyncd.flags}
GRADSYNC_RUN_DIR=${GRADSYNC_RUN_DIR:-/run/gradsync}
GRADSYNC_USER=${GRADSYNC_USER:-gradsync}
GRADSYNC_GROUP=${GRADSYNC_GROUP:-gradsync}
GRADSYNC_LOG_DIR=${GRADSYNC_LOG_DIR:-/var/log/gradsync}
GRADSYNC_WAIT=${GRADSYNC_WAIT:-60}
GRADSYNC_STOP_WAIT=${GRADSYNC_STOP_WAIT:-30}
if [[ -z ${GRADSYNC_SYSLOG:-} ]]; then
  if [[ -S /dev/log ]]; then GRADSYNC_SYSLOG=1; else GRADSYNC_SYSLOG=0; fi
fi
socket=$GRADSYNC_RUN_DIR/gradsyncd.sock
pid_file=$GRADSYNC_RUN_DIR/gradsyncd.slurm-pid
job=${SLURM_JOB_ID:-}

# One line to stderr (slurmd's log shows a failing prolog's) and, with GRADSYNC_SYSLOG=1, syslog.
log() {
  echo "$script_name: job=${job:-?} node=${SLURMD_NODENAME:-$(hostname)} $*" >&2
  if [[ $GRADSYNC_SYSLOG == 1 ]]; then
    logger -t gradsync-slurm -- "$script_name: job=${job:-?} $*" 2>/dev/null || true
  fi
}

# 0 when the daemon at $socket answers SERVING within a second.
serving() {
  timeout 5 "$GRADSYNCCTL" --socket="$socket" --timeout=1s health 2>/dev/null |
    head -n 1 | grep -q ': SERVING$'
}

mode() {
  case $GRADSYNC_SLURM_MODE in
    systemd | job) echo "$GRADSYNC_SLURM_MODE" ;;
    auto)
      if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]] &&
        systemctl is-enabled --quiet gradsyncd.service 2>/dev/null; then
        echo systemd
      else
        echo job
      fi ;;
    *) log "GRADSYNC_SLURM_MODE=$GRADSYNC_SLURM_MODE: want auto, systemd or job"; return 2 ;;
  esac
}
