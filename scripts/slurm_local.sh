#!/bin/sh
# A one-node Slurm cluster on this machine, to try `srun bpslaunch ...` for real (issue 14).
# Needs root and Debian's slurm-wlm (which brings munge):  apt-get install -y slurm-wlm
#
#   scripts/slurm_local.sh start DIR   # munged (if not running), slurmctld and slurmd; state in DIR
#   SLURM_CONF=DIR/slurm.conf srun -n 3 -O .venv/bin/bpslaunch .venv/bin/python train.py
#   scripts/slurm_local.sh stop DIR    # stops the daemons this script started (by their pid files)
set -eu
action=${1:?usage: slurm_local.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: slurm_local.sh start|stop DIR}")

case $action in
start)
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    if [ ! -S /run/munge/munge.socket.2 ]; then
        if [ ! -s /etc/munge/munge.key ]; then
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
        fi
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        mkdir -p /run/munge && chown munge:munge /run/munge
        munged --force --pid-file="$dir/munge/munged.pid"
    fi
    node=$(slurmd -C | head -1)  # NodeName=... CPUs=... exactly as slurmd sees this machine
    name=$(echo "$node" | sed 's/^NodeName=\([^ ]*\).*/\1/')
    cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$name
SlurmctldAddr=127.0.0.1
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
$node NodeAddr=127.0.0.1
PartitionName=local Nodes=$name Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    slurmctld -f "$dir/slurm.conf"
    slurmd -f "$dir/slurm.conf"
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        if SLURM_CONF="$dir/slurm.conf" sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "slurm is up: export SLURM_CONF=$dir/slurm.conf"
            exit 0
        fi
        sleep 1
    done
    echo "slurm did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
    exit 1
    ;;
stop)
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        if [ -s "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
        fi
    done
    ;;
*)
    echo "usage: slurm_local.sh start|stop DIR" >&2
    exit 2
    ;;
esac
