#!/usr/bin/env bash
# Start or stop a real one-node SLURM cluster on 127.0.0.1 (for tests and demos).
#
#   cluster/slurm/local_cluster.sh start  <state_dir>  # last stdout line: export SLURM_CONF=<state_dir>/slurm.conf
#   cluster/slurm/local_cluster.sh stop   <state_dir>
#   cluster/slurm/local_cluster.sh status <state_dir>
#
#   eval "$(sudo cluster/slurm/local_cluster.sh start /tmp/slurm)" && sbatch --wrap 'hostname'
#
# Needs Debian's `slurm-wlm` and `munge` packages and root: slurmctld and slurmd
# run as root, munged as user munge. Everything the cluster writes (config,
# state, spool, logs, pid files) lives under <state_dir>; only munge uses the
# system paths (/etc/munge, /run/munge, /var/lib/munge, /var/log/munge). A
# munged that was already running is reused and never stopped; one this script
# started is stopped by the `stop` of the last local cluster still using it.
#
# The config needs neither systemd nor cgroups, so it works in containers:
# ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, SelectType=
# select/cons_tres with CR_CPU (one CPU per job by default, memory not
# consumed), JobRequeue=1, no accounting storage (`sacct` does not work;
# finished jobs stay visible to `scontrol show job` for MinJobAge=3600 s).
#
# Environment:
#   LOCAL_SLURM_CTLD_PORT      slurmctld port (default: first free pair from 6817)
#   LOCAL_SLURM_D_PORT         slurmd port    (default: slurmctld port + 1)
#   LOCAL_SLURM_TIMEOUT        seconds to wait for the node to become idle (default 60)
#   LOCAL_SLURM_NODE           node name: this host's short name or localhost
#                              (default: `hostname -s`, else localhost); slurmctld
#                              refuses a name that is not this host's
#   LOCAL_SLURM_REQUEUE_DELAY  seconds a requeued job waits before it may start
#                              again (AuthInfo=cred_expire; default 10, Slurm's
#                              own default is 120; Slurm rejects values under 5)
set -euo pipefail

PROG=$(basename "$0")
# Which state dirs use a munged this script started (one file per cluster).
REGISTRY=/run/local-slurm

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

log() {
    echo "$PROG: $*" >&2
}

usage() {
    echo "usage: $PROG {start|stop|status} <state_dir>" >&2
    exit 2
}

# True when something accepts TCP connections on 127.0.0.1:$1.
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# True when the pid stored in file $1 is alive and its command line contains $2.
pid_alive() {
    local pid cmd
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmd == *"$2"* ]]
}

# Stop the process whose pid is in file $1 (command line containing $2):
# SIGTERM, then SIGKILL after $3 seconds.
stop_pidfile() {
    local file=$1 match=$2 grace=$3 pid i
    pid_alive "$file" "$match" || { rm -f "$file"; return 0; }
    pid=$(<"$file")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
        sleep 0.1
    done
    log "pid $pid ($match) ignored SIGTERM for ${grace}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

# Print the last lines of the given log files (default: the SLURM daemons' logs).
tail_logs() {
    local f
    (($# > 0)) || set -- "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" \
        "$STATE/log/slurmctld.stdio" "$STATE/log/slurmd.stdio"
    for f in "$@"; do
        if [[ -s $f ]]; then
            echo "---- last lines of $f ----" >&2
            tail -n 25 "$f" >&2
        fi
    done
}

munge_works() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

start_munge() {
    if munge_works; then
        return 0
    fi
    command -v munged >/dev/null || die "munged not found (apt-get install munge)"
    mkdir -p /run/munge /etc/munge /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /run/munge /etc/munge /var/lib/munge /var/log/munge /etc/munge/munge.key
    chmod 0755 /run/munge
    chmod 0700 /etc/munge /var/log/munge
    chmod 0711 /var/lib/munge
    chmod 0600 /etc/munge/munge.key
    # A stale socket or pid file from a killed munged blocks a new one.
    if [[ -e /run/munge/munged.pid ]] && ! pid_alive /run/munge/munged.pid munged; then
        rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    fi
    local runas=(runuser -u munge --)
    command -v runuser >/dev/null || runas=(sudo -u munge)
    "${runas[@]}" munged --pid-file=/run/munge/munged.pid \
        </dev/null >>"$STATE/log/munged.stdio" 2>&1 ||
        { tail_logs "$STATE/log/munged.stdio" /var/log/munge/munged.log; die "munged failed to start"; }
    local i
    for ((i = 0; i < 100; i++)); do
        if munge_works && [[ -s /run/munge/munged.pid ]]; then
            mkdir -p "$REGISTRY"
            cp /run/munge/munged.pid "$REGISTRY/munged.pid"
            log "started munged (pid $(<"$REGISTRY/munged.pid"))"
            return 0
        fi
        sleep 0.1
    done
    tail_logs "$STATE/log/munged.stdio" /var/log/munge/munged.log
    die "munged started but 'munge -n | unmunge' does not work"
}

# The registry entry of this state dir (a short name derived from its path).
registry_entry() {
    echo "$REGISTRY/cluster-$(printf '%s' "$STATE" | md5sum | cut -c1-16)"
}

# Stop munged if this script started it and no other live local cluster uses it.
maybe_stop_munge() {
    local entry other
    [[ -s $REGISTRY/munged.pid ]] || return 0
    for entry in "$REGISTRY"/cluster-*; do
        [[ -s $entry ]] || continue
        other=$(<"$entry")
        if pid_alive "$other/run/slurmctld.pid" "$other/slurm.conf"; then
            log "munged is still used by the cluster in $other; leaving it running"
            return 0
        fi
        rm -f "$entry"
    done
    if [[ -s /run/munge/munged.pid ]] && cmp -s "$REGISTRY/munged.pid" /run/munge/munged.pid; then
        stop_pidfile "$REGISTRY/munged.pid" munged 5
    fi
    rm -f "$REGISTRY/munged.pid"
}

pick_ports() {
    local p
    if [[ -n ${LOCAL_SLURM_CTLD_PORT:-} ]]; then
        CTLD_PORT=$LOCAL_SLURM_CTLD_PORT
        D_PORT=${LOCAL_SLURM_D_PORT:-$((CTLD_PORT + 1))}
        port_in_use "$CTLD_PORT" && die "port $CTLD_PORT (LOCAL_SLURM_CTLD_PORT) is in use"
        port_in_use "$D_PORT" && die "port $D_PORT (LOCAL_SLURM_D_PORT) is in use"
        return 0
    fi
    for ((p = 6817; p < 6917; p += 2)); do
        if ! port_in_use "$p" && ! port_in_use "$((p + 1))"; then
            CTLD_PORT=$p
            D_PORT=$((p + 1))
            return 0
        fi
    done
    die "no free port pair in 6817-6916; set LOCAL_SLURM_CTLD_PORT"
}

write_conf() {
    local cpus mem
    cpus=$(nproc)
    # RealMemory in MiB, a little under the total so slurmd does not drain the node.
    mem=$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')
    [[ $mem =~ ^[0-9]+$ && $mem -gt 0 ]] || mem=1024
    cat >"$CONF" <<EOF
# Written by cluster/slurm/local_cluster.sh: a one-node test cluster on 127.0.0.1.
ClusterName=localtest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again.
AuthInfo=cred_expire=$REQUEUE_DELAY
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
# No systemd or cgroups in a container: track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s instead of every 60 s.
SchedulerParameters=sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
# Without accounting storage, finished jobs are only visible to scontrol until MinJobAge.
MinJobAge=3600
KillWait=10
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeHostname=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

# Print the node's state as sinfo sees it (empty when slurmctld does not answer).
node_state() {
    SLURM_CONF=$CONF sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1 || true
}

cmd_start() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmctld and slurmd run as root here)"
    local b
    for b in slurmctld slurmd sinfo scontrol munge unmunge; do
        command -v "$b" >/dev/null || die "$b not found (apt-get install slurm-wlm munge)"
    done
    [[ $REQUEUE_DELAY =~ ^[0-9]+$ && $REQUEUE_DELAY -ge 5 ]] ||
        die "LOCAL_SLURM_REQUEUE_DELAY must be an integer >= 5 (got '$REQUEUE_DELAY')"
    # slurmstepd puts unix sockets named <node>_<job>.<step> in the spool dir; they
    # must fit in sun_path (108 bytes).
    local sock="$STATE/spool/${NODE}_4294967294.4294967294"
    ((${#sock} < 108)) || die "state dir path too long for slurmstepd sockets ($sock); use a shorter one"
    mkdir -p "$STATE"/{ctld,spool,log,run}

    if pid_alive "$STATE/run/slurmctld.pid" "$CONF" || pid_alive "$STATE/run/slurmd.pid" "$CONF"; then
        if pid_alive "$STATE/run/slurmctld.pid" "$CONF" && pid_alive "$STATE/run/slurmd.pid" "$CONF" &&
            [[ $(node_state) =~ ^(idle|mixed|allocated) ]]; then
            log "already running with state dir $STATE"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        die "a half-started cluster uses $STATE; run '$PROG stop $STATE' first"
    fi

    # Keep the previous run's logs apart, so errors below are about this run.
    local f
    for f in "$STATE"/log/*.log "$STATE"/log/*.stdio; do
        if [[ -e $f ]]; then mv -f "$f" "$f.prev"; fi
    done
    start_munge
    pick_ports
    write_conf
    mkdir -p "$REGISTRY"
    echo "$STATE" >"$(registry_entry)"
    log "slurm.conf: $CONF (node $NODE, ports $CTLD_PORT/$D_PORT)"

    # -c: start clean, so a reused state dir does not bring back old jobs.
    SLURM_CONF=$CONF slurmctld -c -f "$CONF" </dev/null >>"$STATE/log/slurmctld.stdio" 2>&1 ||
        fail_start "slurmctld failed to start"
    SLURM_CONF=$CONF slurmd -f "$CONF" -N "$NODE" </dev/null >>"$STATE/log/slurmd.stdio" 2>&1 ||
        fail_start "slurmd failed to start"

    local timeout=${LOCAL_SLURM_TIMEOUT:-60} start state="" resumed=0
    start=$SECONDS
    while ((SECONDS - start < timeout)); do
        state=$(node_state)
        if [[ $state == idle ]]; then
            log "node $NODE idle after $((SECONDS - start))s"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        if [[ $state =~ ^(down|drain) ]] && ((resumed == 0 && SECONDS - start > 5)); then
            SLURM_CONF=$CONF scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
            resumed=1
        fi
        if ((SECONDS - start > 2)) && ! pid_alive "$STATE/run/slurmctld.pid" "$CONF"; then
            fail_start "slurmctld is not running"
        fi
        sleep 0.5
    done
    fail_start "node $NODE not idle after ${timeout}s (last state: '${state:-no answer}')"
}

# Show the logs, stop whatever this start left running, and exit with an error.
fail_start() {
    tail_logs
    cmd_stop 2>/dev/null || true
    die "$1; logs in $STATE/log"
}

cmd_stop() {
    [[ -d $STATE ]] || { log "no state dir $STATE; nothing to stop"; return 0; }
    if [[ -s $CONF ]] && pid_alive "$STATE/run/slurmctld.pid" "$CONF"; then
        # Cancel jobs so their slurmstepd and user processes do not outlive the cluster.
        local jobs i
        jobs=$(SLURM_CONF=$CONF squeue -h -o '%i' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086  # one word per job id
            SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 30; i++)); do
                [[ -z $(SLURM_CONF=$CONF squeue -h -o '%i' 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_pidfile "$STATE/run/slurmd.pid" "$CONF" 10
    stop_pidfile "$STATE/run/slurmctld.pid" "$CONF" 10
    rm -f "$(registry_entry)"
    maybe_stop_munge
    log "stopped the cluster in $STATE"
}

cmd_status() {
    local s
    [[ -s $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    s=$(node_state)
    echo "slurmctld: $(pid_alive "$STATE/run/slurmctld.pid" "$CONF" && echo running || echo stopped)"
    echo "slurmd:    $(pid_alive "$STATE/run/slurmd.pid" "$CONF" && echo running || echo stopped)"
    echo "node $NODE: ${s:-no answer}"
    [[ $s =~ ^(idle|mixed|allocated) ]]
}

[[ $# -eq 2 ]] || usage
ACTION=$1
[[ $ACTION != start ]] || mkdir -p "$2"
if [[ -d $2 ]]; then STATE=$(cd "$2" && pwd -P); else STATE=$2; fi
CONF=$STATE/slurm.conf
NODE=${LOCAL_SLURM_NODE:-$(hostname -s 2>/dev/null || true)}
NODE=${NODE:-localhost}
CTLD_PORT=""
D_PORT=""
REQUEUE_DELAY=${LOCAL_SLURM_REQUEUE_DELAY:-10}

case $ACTION in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) usage ;;
esac
