#!/usr/bin/env bash
# A two-node Slurm cluster on this one host, for the tests marked `slurm` (Debian 12, Slurm 22.05,
# run as root): munged, slurmctld and two slurmd (nodes n1 and n2, ports 6818-6819) with their
# configuration, state, logs and pid files under DIR.
#
#   .ci/slurm_cluster.sh start DIR   install the packages when missing, start the daemons, wait until
#                                    both nodes are idle; prints `export SLURM_CONF=DIR/slurm.conf`
#   .ci/slurm_cluster.sh stop DIR    stop every daemon started in DIR by its pid, waiting until it is gone
#
# Exit status 3 when the cluster cannot start here (not root, no apt-get, the packages do not
# install, the nodes do not come up); the reason is on stderr.
set -euo pipefail

action=${1:-}
dir=${2:-}
if [[ -z "$action" || -z "$dir" ]]; then
    echo "usage: $0 start|stop DIR" >&2
    exit 2
fi
dir=$(realpath -m "$dir")
cannot() { echo "slurm cluster: $*" >&2; exit 3; }

daemon_pidfiles() { ls "$dir"/pids/*.pid 2>/dev/null || true; }

stop() {
    local pidfile pid pids=()
    for pidfile in $(daemon_pidfiles); do
        pid=$(cat "$pidfile" 2>/dev/null || true)
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            kill -CONT "$pid" 2>/dev/null || true  # a test may have paused it
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$pidfile"
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
            while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
        fi
    done
}

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return 0
    [[ $(id -u) == 0 ]] || cannot "not root: cannot install slurmctld slurmd slurm-client munge"
    command -v apt-get >/dev/null || cannot "no apt-get: install slurmctld slurmd slurm-client munge by hand"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurmctld slurmd slurm-client munge >"$dir/apt.log" 2>&1 \
        || { apt-get update -q >>"$dir/apt.log" 2>&1 && apt-get install -y -q slurmctld slurmd slurm-client munge >>"$dir/apt.log" 2>&1; } \
        || cannot "apt-get install slurmctld slurmd slurm-client munge failed (see $dir/apt.log)"
}

write_conf() {
    local host
    host=$(hostname)
    cat >"$dir/slurm.conf" <<EOF
ClusterName=megacli-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Credentials expire quickly, so a requeued job can start again within seconds.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/pids/slurmctld.pid
SlurmdPidFile=$dir/pids/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobRequeue=1
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=1
SlurmdTimeout=10
KillWait=10
InactiveLimit=0
MinJobAge=600
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[6818-6819] CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    mkdir -p "$dir"/{state,spool/n1,spool/n2,pids,log,munge}
    stop  # whatever an earlier start in DIR left running
    install
    write_conf
    export SLURM_CONF=$dir/slurm.conf
    # munged as root (--force): DIR may sit in a private temp directory the munge user cannot enter,
    # and every job of this cluster runs as root anyway.
    chmod 0700 "$dir/munge"
    munged --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
        || cannot "munged did not start (see $dir/munge/munged.log)"
    for _ in $(seq 50); do [[ -s "$dir/munge/munged.pid" ]] && break; sleep 0.1; done
    cp "$dir/munge/munged.pid" "$dir/pids/munged.pid"
    slurmctld -f "$SLURM_CONF" || cannot "slurmctld did not start (see $dir/log/slurmctld.log)"
    slurmd -f "$SLURM_CONF" -N n1 || cannot "slurmd -N n1 did not start (see $dir/log/slurmd-n1.log)"
    slurmd -f "$SLURM_CONF" -N n2 || cannot "slurmd -N n2 did not start (see $dir/log/slurmd-n2.log)"
    for _ in $(seq 120); do
        if [[ $(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) == 2 ]]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.5
    done
    sinfo -N >&2 || true
    stop
    cannot "the nodes did not become idle within 60 s (see $dir/log)"
}

case "$action" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
