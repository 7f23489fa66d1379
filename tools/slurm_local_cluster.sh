#!/usr/bin/env bash
# Start or stop a real SLURM cluster on this machine (for tests, demos, and trying multi-node jobs).
#
#   tools/slurm_local_cluster.sh start [--nodes N] <state_dir>  # last stdout line: export SLURM_CONF=...
#   tools/slurm_local_cluster.sh stop   <state_dir>
#   tools/slurm_local_cluster.sh status <state_dir>
#   tools/slurm_local_cluster.sh exec   <state_dir> <node> <command...>   # run a command on a node
#   tools/slurm_local_cluster.sh check  [--nodes N]                       # can this machine run one?
#
#   eval "$(sudo tools/slurm_local_cluster.sh start /tmp/slurm)" && sbatch --wrap 'hostname'
#   eval "$(sudo tools/slurm_local_cluster.sh start --nodes 2 /tmp/slurm2)" && sinfo
#
# One node (the default): slurmctld and one slurmd on 127.0.0.1, the node named after this host.
#
# Several nodes (--nodes N, N >= 2): slurmctld in this host's network namespace and N slurmd
# named node0..node<N-1>, each in its own network namespace (a veth pair on a bridge the script
# creates, addresses 10.200.<k>.10+i in a /24 no interface or route here uses, the bridge at
# 10.200.<k>.1; no default route and no forwarding, so nothing leaves the machine), its own UTS
# namespace (hostname node<i>) and its own mount namespace, where /etc/hosts lists the nodes
# and <state_dir>/scratch is that node's own folder (<state_dir>/nodes/<node>/scratch as seen
# from this host). Every task gets TMPDIR=<state_dir>/scratch (a TaskProlog), so
# node-local staging really is per node. Jobs run inside their node's namespaces: `hostname`,
# name resolution and addresses look like separate machines, while the file system (run
# directories, the repository, munge's socket) is shared, as on a cluster. Needs root with
# CAP_SYS_ADMIN and CAP_NET_ADMIN (`check --nodes 2` says whether this machine allows it).
# Debian's slurm-wlm 22.05 is built with --enable-multiple-slurmd, but the namespaces, not
# that option, make each slurmd its own node: it has its own hostname and address, and only
# its spool, log and pid file names carry the node name (%n in slurm.conf).
#
# Needs Debian's `slurm-wlm` and `munge` packages and root: slurmctld and slurmd run as root,
# munged as user munge. Everything the cluster writes (config, state, spool, logs, pid files,
# node folders) lives under <state_dir>; only munge uses the system paths (/etc/munge,
# /run/munge, /var/lib/munge, /var/log/munge), and several nodes add namespaces under
# /run/netns and network links named after the state dir. A munged that was already running
# is reused and never stopped; one this script started is stopped by the `stop` of the last
# local cluster still using it. `stop` also cleans up after a failed or interrupted `start`:
# it ends every process left in the nodes' namespaces and deletes the namespaces and links
# (the nodes' mounts live only in their mount namespaces and go with their last process).
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
#   LOCAL_SLURM_TIMEOUT        seconds to wait for the nodes to become idle (default 60)
#   LOCAL_SLURM_NODE           one node: its name, this host's short name or localhost
#                              (default: `hostname -s`, else localhost); slurmctld
#                              refuses a name that is not this host's
#   LOCAL_SLURM_REQUEUE_DELAY  seconds a requeued job waits before it may start
#                              again (AuthInfo=cred_expire; default 10, Slurm's
#                              own default is 120; Slurm rejects values under 5)
set -euo pipefail

PROG=$(basename "$0")
# Which state dirs use a munged this script started (one file per cluster).
REGISTRY=/run/local-slurm
# Several nodes: the /24 networks tried, 10.200.0.0/24 to 10.200.255.0/24.
NET_PREFIX=10.200

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

log() {
    echo "$PROG: $*" >&2
}

usage() {
    echo "usage: $PROG start [--nodes N] <state_dir> | stop <state_dir> | status <state_dir>" \
        "| exec <state_dir> <node> <command...> | check [--nodes N]" >&2
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

# True when any of the pids $@ is alive.
any_alive() {
    local pid
    for pid in "$@"; do
        if kill -0 "$pid" 2>/dev/null; then return 0; fi
    done
    return 1
}

# Stop the processes whose pids are in files $3... (command lines containing $1): SIGTERM to
# all at once, then SIGKILL to those still alive after $2 seconds.
stop_pidfiles() {
    local match=$1 grace=$2 file pid i pids=()
    shift 2
    for file in "$@"; do
        if pid_alive "$file" "$match"; then
            pid=$(<"$file")
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$file"
    done
    for ((i = 0; i < grace * 10; i++)); do
        any_alive "${pids[@]}" || return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid ($match) ignored SIGTERM for ${grace}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

# Print the last lines of the given log files (default: the SLURM daemons' logs).
tail_logs() {
    local f
    (($# > 0)) || set -- "$STATE"/log/slurmctld.log "$STATE"/log/slurmd*.log \
        "$STATE"/log/slurmctld.stdio "$STATE"/log/slurmd*.stdio
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
        [[ -s $entry && $entry != *.ports ]] || continue
        other=$(<"$entry")
        if pid_alive "$other/run/slurmctld.pid" "$other/slurm.conf"; then
            log "munged is still used by the cluster in $other; leaving it running"
            return 0
        fi
        rm -f "$entry"
    done
    if [[ -s /run/munge/munged.pid ]] && cmp -s "$REGISTRY/munged.pid" /run/munge/munged.pid; then
        stop_pidfiles munged 5 "$REGISTRY/munged.pid"
    fi
    rm -f "$REGISTRY/munged.pid"
}

# The slurmctld ports other local clusters hold, or claimed in the last 5 minutes while starting:
# a port is free to connect to until its slurmctld binds it, which a two-node start does only
# after setting up its network.
claimed_ports() {
    local claim state
    for claim in "$REGISTRY"/cluster-*.ports; do
        [[ -s $claim ]] || continue
        state=$(cat "${claim%.ports}" 2>/dev/null) || state=""
        if [[ -n $(find "$claim" -mmin -5) ]] || pid_alive "$state/run/slurmctld.pid" "$state/slurm.conf"; then
            cat "$claim"
        fi
    done
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
    local claimed
    claimed=" $(claimed_ports | tr '\n' ' ') "
    for ((p = 6817; p < 6917; p += 2)); do
        if [[ $claimed != *" $p "* ]] && ! port_in_use "$p" && ! port_in_use "$((p + 1))"; then
            CTLD_PORT=$p
            D_PORT=$((p + 1))
            return 0
        fi
    done
    die "no free port pair in 6817-6916; set LOCAL_SLURM_CTLD_PORT"
}

# ---- several nodes: names, network, namespaces --------------------------------------------

# Names of what several nodes create, derived from the state dir so that `stop` finds them
# even when `start` failed half-way: namespaces local-slurm-<tag>-node<i>, the bridge lsb<tag>
# and the host ends of the veth pairs lsv<tag>-<i> (interface names have at most 15 bytes).
netns_name() { echo "local-slurm-$TAG-node$1"; }
veth_name() { echo "lsv$TAG-$1"; }
node_name() { echo "node$1"; }

# The nodes of the cluster in $STATE (from the nodes file `start` writes), one per line.
node_names() {
    [[ -s $STATE/nodes.env ]] || return 0
    local count i
    count=$(sed -n 's/^NODES=//p' "$STATE/nodes.env")
    for ((i = 0; i < count; i++)); do node_name "$i"; done
}

# The tools, and a throwaway namespace in which a veth pair and a bridge can be made.
check_multinode() {
    local b out
    for b in ip nsenter unshare flock hostname; do
        command -v "$b" >/dev/null || die "$b not found (apt-get install iproute2 util-linux hostname)"
    done
    out=$(unshare --net --uts --mount -- sh -c \
        'ip link add lsprobe0 type veth peer name lsprobe1 && ip link add lsprobe2 type bridge' 2>&1) ||
        die "cannot create network namespaces, veth pairs and bridges here ($(head -n 1 <<<"$out")):" \
            "--nodes $NODES needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN, not an unprivileged container"
}

# The first 10.200.<k> whose /24 no interface address or route of this host uses.
pick_subnet() {
    local k used
    used=$( (ip -4 -o addr show; ip -4 route show) | grep -oE "\b$NET_PREFIX\.[0-9]+\." | sort -u || true)
    for ((k = 0; k < 256; k++)); do
        if ! grep -qx "$NET_PREFIX\.$k\." <<<"$used"; then
            SUBNET=$NET_PREFIX.$k
            return 0
        fi
    done
    die "every /24 of $NET_PREFIX.0.0/16 is in use on this host"
}

# The bridge on this host and one namespace with a veth pair per node, made under a lock so
# that two clusters starting at once never pick the same subnet.
setup_network() {
    local i ns veth
    mkdir -p "$REGISTRY"
    exec 9>"$REGISTRY/network.lock"
    flock 9
    # `ip netns add` makes /run/netns a mount point the first time; the last stop undoes it.
    if ! mountpoint -q /run/netns; then touch "$REGISTRY/netns-mount"; fi
    pick_subnet
    printf 'NODES=%s\nSUBNET=%s\n' "$NODES" "$SUBNET" >"$STATE/nodes.env"
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 0; i < NODES; i++)); do
        ns=$(netns_name "$i")
        veth=$(veth_name "$i")
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
    flock -u 9
    exec 9>&-
    {
        echo "# Written by $PROG: /etc/hosts on the nodes of the cluster in $STATE."
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$SUBNET.1 $CTLD_HOST"
        for ((i = 0; i < NODES; i++)); do echo "$SUBNET.$((10 + i)) $(node_name "$i")"; done
    } >"$STATE/hosts"
    log "network $SUBNET.0/24: bridge $BRIDGE ($SUBNET.1), nodes at $SUBNET.10-$((10 + NODES - 1))"
}

# Start slurmd for node $1 in its namespaces: the node's network namespace, and new UTS and
# mount namespaces where the hostname, /etc/hosts and the scratch folder are the node's own.
# Mount propagation is "slave": mounts made on the host still show on the nodes, the nodes'
# mounts never show on the host and vanish with the namespace.
start_node_slurmd() {
    local i=$1 name
    name=$(node_name "$i")
    mkdir -p "$STATE/nodes/$name/scratch" "$STATE/spool/$name"
    chmod 1777 "$STATE/nodes/$name/scratch"  # like /tmp: any user's jobs write there
    # shellcheck disable=SC2016  # the node's own shell expands its arguments
    nsenter --net="/run/netns/$(netns_name "$i")" unshare --uts --mount --propagation slave -- \
        bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" &&
                 exec slurmd -f "$5" -N "$1"' node-setup \
        "$name" "$STATE/hosts" "$STATE/nodes/$name/scratch" "$STATE/scratch" "$CONF" \
        </dev/null >>"$STATE/log/slurmd-$name.stdio" 2>&1
}

# Nodes talk to each other across the bridge (srun, the rendezvous, gloo), not only to
# slurmctld. Where br_netfilter passes bridged packets through iptables, a FORWARD policy of
# DROP (Docker sets one) cuts node-to-node traffic while every node still reaches slurmctld
# and shows idle: check that node0 reaches every other node's slurmd.
check_node_links() {
    local i addr
    for ((i = 1; i < NODES; i++)); do
        addr=$SUBNET.$((10 + i))
        nsenter --net="/run/netns/$(netns_name 0)" timeout 5 bash -c "exec 3<>/dev/tcp/$addr/$D_PORT" 2>/dev/null ||
            fail_start "node0 cannot reach $(node_name "$i") at $addr:$D_PORT across the bridge $BRIDGE;" \
                "if a firewall drops forwarded packets (Docker sets iptables' FORWARD policy to DROP)," \
                "allow the bridge: iptables -I FORWARD -i $BRIDGE -o $BRIDGE -j ACCEPT"
    done
}

# End every process left in the namespaces of this state dir (SIGTERM, then SIGKILL), then
# delete the namespaces, the veth pairs and the bridge.
teardown_network() {
    command -v ip >/dev/null || return 0
    local namespaces=() ns pids i link
    mapfile -t namespaces < <(ip netns list 2>/dev/null | awk -v p="local-slurm-$TAG-node" 'index($1, p) == 1 {print $1}')
    for ns in "${namespaces[@]}"; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            log "ending processes left in $ns: $(tr '\n' ' ' <<<"$pids")"
            # shellcheck disable=SC2086  # one word per pid
            kill -TERM $pids 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] && break
                sleep 0.1
            done
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            # shellcheck disable=SC2086
            if [[ -n $pids ]]; then kill -KILL $pids 2>/dev/null || true; fi
        fi
        ip netns del "$ns" 2>/dev/null || log "could not delete network namespace $ns"
    done
    for link in $(ip -o link show 2>/dev/null | awk -F': ' -v t="lsv$TAG-" 'index($2, t) == 1 {sub(/@.*/, "", $2); print $2}'); do
        ip link del "$link" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE" || log "could not delete bridge $BRIDGE"
    fi
    rm -f "$STATE/nodes.env"
    if [[ -e $REGISTRY/netns-mount ]]; then
        exec 9>"$REGISTRY/network.lock"
        flock 9
        if mountpoint -q /run/netns && [[ -z $(ls -A /run/netns) ]]; then
            umount /run/netns && rm -f "$REGISTRY/netns-mount"
        fi
        flock -u 9
        exec 9>&-
    fi
}

# ---- slurm.conf ----------------------------------------------------------------------------

write_conf() {
    local cpus mem i name
    cpus=$(nproc)
    # RealMemory in MiB, a little under the total so slurmd does not drain the node.
    mem=$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')
    [[ $mem =~ ^[0-9]+$ && $mem -gt 0 ]] || mem=1024
    if ((NODES == 1)); then
        cat >"$CONF" <<EOF
# Written by tools/slurm_local_cluster.sh: a one-node test cluster on 127.0.0.1.
ClusterName=localtest
SlurmctldHost=$NODE(127.0.0.1)
EOF
    else
        cat >"$CONF" <<EOF
# Written by tools/slurm_local_cluster.sh: $NODES nodes, each slurmd in its own network,
# UTS and mount namespace on $SUBNET.0/24; slurmctld on this host's bridge address.
ClusterName=localtest
SlurmctldHost=$CTLD_HOST($SUBNET.1)
EOF
    fi
    cat >>"$CONF" <<EOF
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
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
EOF
    if ((NODES == 1)); then
        cat >>"$CONF" <<EOF
SlurmdSpoolDir=$STATE/spool
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$NODE NodeHostname=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
        return 0
    fi
    cat >"$STATE/task_prolog.sh" <<EOF
#!/bin/sh
# Written by $PROG: every task's TMPDIR is its node's own scratch folder.
echo "export TMPDIR=$STATE/scratch"
EOF
    chmod 0755 "$STATE/task_prolog.sh"
    cat >>"$CONF" <<EOF
# %n: the node name, so the nodes keep their spool, pid and log files apart.
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
# The same path on every node, a different folder behind it on each (a bind mount).
TmpFS=$STATE/scratch
TaskProlog=$STATE/task_prolog.sh
EOF
    for ((i = 0; i < NODES; i++)); do
        name=$(node_name "$i")
        echo "NodeName=$name NodeHostname=$name NodeAddr=$SUBNET.$((10 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=debug Nodes=node[0-$((NODES - 1))] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

# ---- start, stop, status -------------------------------------------------------------------

# "<node> <state>" per node as sinfo sees it (empty when slurmctld does not answer).
node_states() {
    SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null || true
}

# The slurmd pid file of node $1 (one node: the single slurmd's).
slurmd_pidfile() {
    if [[ -s $STATE/nodes.env ]]; then echo "$STATE/run/slurmd-$1.pid"; else echo "$STATE/run/slurmd.pid"; fi
}

# True when slurmctld and every slurmd run and every node is idle, mixed or allocated.
cluster_up() {
    local name states
    pid_alive "$STATE/run/slurmctld.pid" "$CONF" || return 1
    for name in "${NODE_LIST[@]}"; do
        pid_alive "$(slurmd_pidfile "$name")" "$CONF" || return 1
    done
    states=$(node_states)
    [[ $(grep -cE ' (idle|mixed|allocated)' <<<"$states") -eq ${#NODE_LIST[@]} ]]
}

any_daemon_alive() {
    local f
    for f in "$STATE"/run/slurmctld.pid "$STATE"/run/slurmd*.pid; do
        if pid_alive "$f" "$CONF"; then return 0; fi
    done
    return 1
}

cmd_check() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmctld and slurmd run as root here)"
    local b
    for b in slurmctld slurmd sinfo scontrol munge unmunge; do
        command -v "$b" >/dev/null || die "$b not found (apt-get install slurm-wlm munge)"
    done
    if ((NODES > 1)); then check_multinode; fi
}

cmd_start() {
    cmd_check
    [[ $REQUEUE_DELAY =~ ^[0-9]+$ && $REQUEUE_DELAY -ge 5 ]] ||
        die "LOCAL_SLURM_REQUEUE_DELAY must be an integer >= 5 (got '$REQUEUE_DELAY')"
    # slurmstepd puts unix sockets named <node>_<job>.<step> in the spool dir; they
    # must fit in sun_path (108 bytes).
    local sock="$STATE/spool/${NODE_LIST[0]}_4294967294.4294967294"
    ((NODES == 1)) || sock="$STATE/spool/${NODE_LIST[0]}/${NODE_LIST[0]}_4294967294.4294967294"
    ((${#sock} < 108)) || die "state dir path too long for slurmstepd sockets ($sock); use a shorter one"
    mkdir -p "$STATE"/{ctld,spool,log,run}

    if any_daemon_alive || [[ -s $STATE/nodes.env ]]; then
        if [[ $(node_names | wc -l) -eq $((NODES > 1 ? NODES : 0)) ]] && cluster_up; then
            log "already running with state dir $STATE"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        die "a half-started or different cluster uses $STATE; run '$PROG stop $STATE' first"
    fi

    # Keep the previous run's logs apart, so errors below are about this run.
    local f
    for f in "$STATE"/log/*.log "$STATE"/log/*.stdio; do
        if [[ -e $f ]]; then mv -f "$f" "$f.prev"; fi
    done
    start_munge
    mkdir -p "$REGISTRY"
    exec 8>"$REGISTRY/ports.lock"
    flock 8  # two clusters starting at once never pick the same ports
    pick_ports
    echo "$STATE" >"$(registry_entry)"
    echo "$CTLD_PORT" >"$(registry_entry).ports"
    flock -u 8
    if ((NODES > 1)); then
        # From here on a failing command cleans up everything this start made.
        trap 'fail_start "setting up the nodes failed (the command above)"' ERR
        set -o errtrace
        mkdir -p "$STATE/scratch"
        setup_network
        set +o errtrace
        trap - ERR
    fi
    write_conf
    log "slurm.conf: $CONF (nodes ${NODE_LIST[*]}, ports $CTLD_PORT/$D_PORT)"

    # -c: start clean, so a reused state dir does not bring back old jobs.
    SLURM_CONF=$CONF slurmctld -c -f "$CONF" </dev/null >>"$STATE/log/slurmctld.stdio" 2>&1 ||
        fail_start "slurmctld failed to start"
    if ((NODES == 1)); then
        SLURM_CONF=$CONF slurmd -f "$CONF" -N "$NODE" </dev/null >>"$STATE/log/slurmd.stdio" 2>&1 ||
            fail_start "slurmd failed to start"
    else
        local i
        for ((i = 0; i < NODES; i++)); do
            start_node_slurmd "$i" || fail_start "slurmd of $(node_name "$i") failed to start"
        done
    fi

    local timeout=${LOCAL_SLURM_TIMEOUT:-60} start states="" resumed=0 down
    start=$SECONDS
    while ((SECONDS - start < timeout)); do
        states=$(node_states)
        if [[ $(grep -c ' idle$' <<<"$states") -eq $NODES ]]; then
            if ((NODES > 1)); then check_node_links; fi
            log "$NODES node(s) idle after $((SECONDS - start))s: ${NODE_LIST[*]}"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        down=$(awk '$2 ~ /^(down|drain)/ {print $1}' <<<"$states" | paste -sd, -)
        if [[ -n $down ]] && ((resumed == 0 && SECONDS - start > 5)); then
            SLURM_CONF=$CONF scontrol update NodeName="$down" State=RESUME >/dev/null 2>&1 || true
            resumed=1
        fi
        if ((SECONDS - start > 2)) && ! pid_alive "$STATE/run/slurmctld.pid" "$CONF"; then
            fail_start "slurmctld is not running"
        fi
        sleep 0.5
    done
    fail_start "not all $NODES node(s) idle after ${timeout}s (last states: '$(tr '\n' ' ' <<<"${states:-no answer}")')"
}

# Show the logs, stop whatever this start left running, and exit with an error.
fail_start() {
    trap - ERR
    set +o errtrace
    tail_logs
    cmd_stop 2>/dev/null || true
    die "$*; logs in $STATE/log"
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
    stop_pidfiles "$CONF" 10 "$STATE"/run/slurmd*.pid "$STATE/run/slurmctld.pid"
    teardown_network
    rm -f "$(registry_entry)" "$(registry_entry).ports"
    maybe_stop_munge
    log "stopped the cluster in $STATE"
}

cmd_status() {
    local name s states up=0
    [[ -s $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    states=$(node_states)
    echo "slurmctld: $(pid_alive "$STATE/run/slurmctld.pid" "$CONF" && echo running || echo stopped)"
    for name in "${NODE_LIST[@]}"; do
        s=$(awk -v n="$name" '$1 == n {print $2}' <<<"$states")
        echo "node $name: slurmd $(pid_alive "$(slurmd_pidfile "$name")" "$CONF" && echo running || echo stopped)," \
            "${s:-no answer}"
        if [[ $s =~ ^(idle|mixed|allocated) ]]; then up=$((up + 1)); fi
    done
    ((up == ${#NODE_LIST[@]}))
}

# Run a command on one node of a several-node cluster: in its slurmd's namespaces, with the
# node's TMPDIR, in the current directory (the file system is shared).
cmd_exec() {
    local name=$1 pidfile
    shift
    [[ -s $STATE/nodes.env ]] || die "$STATE holds no several-node cluster (start it with --nodes N)"
    # Not `node_names | grep -q`: grep stops reading at the first match, and under pipefail the
    # writer's SIGPIPE would fail the test for a node that is there.
    grep -qx "$name" <<<"$(node_names)" || die "no node '$name' in $STATE (nodes: $(node_names | paste -sd' ' -))"
    pidfile=$(slurmd_pidfile "$name")
    pid_alive "$pidfile" "$CONF" || die "the slurmd of $name is not running; start the cluster first"
    exec nsenter --target "$(<"$pidfile")" --net --uts --mount --wd="$PWD" -- \
        env TMPDIR="$STATE/scratch" SLURM_CONF="$CONF" "$@"
}

NODES=1
ACTION=${1:-}
[[ $# -gt 0 ]] && shift
if [[ $ACTION == start || $ACTION == check ]] && [[ ${1:-} == --nodes ]]; then
    [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || die "--nodes needs a positive number (got '${2:-}')"
    NODES=$2
    ((NODES <= 200)) || die "--nodes $NODES: at most 200 nodes"
    shift 2
fi
if [[ $ACTION == check ]]; then
    [[ $# -eq 0 ]] || usage
    cmd_check
    echo "this machine can run a local SLURM cluster of $NODES node(s)"
    exit 0
fi
if [[ $ACTION == exec ]]; then [[ $# -ge 3 ]] || usage; else [[ $# -eq 1 ]] || usage; fi
[[ $ACTION != start ]] || mkdir -p "$1"
if [[ -d $1 ]]; then STATE=$(cd "$1" && pwd -P); else STATE=$1; fi
shift
CONF=$STATE/slurm.conf
NODE=${LOCAL_SLURM_NODE:-$(hostname -s 2>/dev/null || true)}
NODE=${NODE:-localhost}
CTLD_HOST=$NODE
TAG=$(printf '%s' "$STATE" | md5sum | cut -c1-8)
BRIDGE=lsb$TAG
SUBNET=""
CTLD_PORT=""
D_PORT=""
REQUEUE_DELAY=${LOCAL_SLURM_REQUEUE_DELAY:-10}
# The nodes this command is about: those being started, else those the state dir records.
NODE_LIST=()
if [[ $ACTION == start ]]; then
    if ((NODES == 1)); then NODE_LIST=("$NODE"); else
        for ((n = 0; n < NODES; n++)); do NODE_LIST+=("$(node_name "$n")"); done
    fi
else
    mapfile -t NODE_LIST < <(node_names)
    if ((${#NODE_LIST[@]} == 0)); then NODE_LIST=("$NODE"); fi
    NODES=${#NODE_LIST[@]}
    SUBNET=$(sed -n 's/^SUBNET=//p' "$STATE/nodes.env" 2>/dev/null || true)
fi

case $ACTION in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    exec) cmd_exec "$@" ;;
    *) usage ;;
esac
