#!/usr/bin/env bash
# One machine's part of an msinfer Ray cluster: start a Ray head (or join one), optionally run a
# job against the cluster, and stop this machine's Ray node when the script exits.
#
# This machine's Ray node is a `ray start --block` process in the background. Stopping it (SIGTERM)
# drains the node and stops exactly the Ray processes it started. `ray stop` is not used: it stops
# every Ray process of the user on the machine, other clusters and other jobs included.
set -euo pipefail

PROG=msinfer-node.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
    cat <<'EOF'
Usage: msinfer-node.sh [options] [JOB.yaml [msinfer run options...]]

Starts a Ray head on this machine (or joins a cluster with --join), then:
  with JOB.yaml   waits for --expect-nodes nodes, runs `msinfer run JOB.yaml --set ray.address=...`
                  with any options after JOB.yaml (e.g. --overwrite, --set key=value), then stops
                  this machine's Ray node and exits with msinfer's exit code;
  without         keeps the node up until interrupted (Ctrl-C, SIGTERM), then stops it.

Options:
  --head                 start a Ray head here (the default)
  --join HOST:PORT       join the cluster whose head listens at HOST:PORT
  --port PORT            the head's port (default 6379)
  --node-ip IP           this machine's address for Ray and MindSpore (default: the first IPv4
                         address of --interface, or of `hostname -I`); never 0.0.0.0
  --interface NAME       take --node-ip from this network interface (e.g. ib0, eth0)
  --num-cpus N           CPU slots Ray may fill here (default: the cores; with JOB.yaml on one
                         machine, as many as its workers ask for where that is more)
  --npus N               Ascend NPUs Ray may use here (default: Ray counts /dev/davinci*; restrict
                         the cards with ASCEND_RT_VISIBLE_DEVICES=0,1,... before starting)
  --expect-nodes N       with JOB.yaml: wait until the cluster has N nodes (default 1)
  --timeout SECONDS      how long to wait for the node and for --expect-nodes (default 600)
  --dashboard            start the Ray dashboard and job server on --node-ip (default: off)
  --dashboard-port PORT  its port (default 8265), where `ray job submit --address http://IP:PORT` goes
  --temp-dir DIR         Ray's temporary folder on this machine (default: Ray's, /tmp/ray)
  --log FILE             Ray's start-up output (default: $TMPDIR/msinfer-node.HOST.PID.log)
  --ray-arg ARG          pass ARG to `ray start` (repeatable)
  --print-ip             print the address --node-ip would be and exit
  -h, --help             this help

Environment: RAY and MSINFER name the `ray` and `msinfer` commands (default: on PATH, else the
repository's .venv/bin). Every node of a cluster needs the same Ray token: a shared home
(~/.ray/auth_token), or RAY_AUTH_TOKEN set alike on every node. The node's workers run with the
jemalloc Ray ships (or your own LD_PRELOAD); RAY_LD_PRELOAD_ON_WORKERS=0 keeps glibc's malloc.

Examples:
  msinfer-node.sh configs/demo.yaml                        # one machine: head, job, stop
  msinfer-node.sh --head --port 6379                       # machine A: head, serve until Ctrl-C
  msinfer-node.sh --join 10.0.0.1:6379                     # machine B: join, serve until Ctrl-C
  msinfer-node.sh --join 10.0.0.1:6379 job.yaml            # machine B: join and drive a job
  msinfer-node.sh --expect-nodes 2 configs/multinode.yaml  # head that waits for one more node
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2 || true; }   # never fail: cleanup uses it with a closed stderr

need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
need_int() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 expects a whole number, got '$2'"; }

mode=head join_addr="" port=6379 node_ip="" interface="" num_cpus="" npus="" expect_nodes=1
timeout=600 dashboard=0 dashboard_port=8265 temp_dir="" log="" print_ip=0 spec="" ray_args=() run_args=()
while [[ $# -gt 0 ]]; do
    arg=$1
    if [[ $arg == --*=* ]]; then       # --opt=value is --opt value
        set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
        arg=$1
    fi
    case $arg in
        -h|--help) usage; exit 0 ;;
        --head) mode="head"; shift ;;
        --join) need_value "$@"; mode="join"; join_addr=$2; shift 2 ;;
        --port) need_value "$@"; need_int "$1" "$2"; port=$2; shift 2 ;;
        --node-ip) need_value "$@"; node_ip=$2; shift 2 ;;
        --interface) need_value "$@"; interface=$2; shift 2 ;;
        --num-cpus) need_value "$@"; need_int "$1" "$2"; num_cpus=$2; shift 2 ;;
        --npus) need_value "$@"; need_int "$1" "$2"; npus=$2; shift 2 ;;
        --expect-nodes) need_value "$@"; need_int "$1" "$2"; expect_nodes=$2; shift 2 ;;
        --timeout) need_value "$@"; need_int "$1" "$2"; timeout=$2; shift 2 ;;
        --dashboard) dashboard=1; shift ;;
        --dashboard-port) need_value "$@"; need_int "$1" "$2"; dashboard_port=$2; shift 2 ;;
        --temp-dir) need_value "$@"; temp_dir=$2; shift 2 ;;
        --log) need_value "$@"; log=$2; shift 2 ;;
        --ray-arg) need_value "$@"; ray_args+=("$2"); shift 2 ;;
        --print-ip) print_ip=1; shift ;;
        --) shift; [[ $# -gt 0 ]] && { spec=$1; shift; run_args=("$@"); }; break ;;
        -*) die "unknown option '$arg' (see --help)" ;;
        *) spec=$1; shift; run_args=("$@"); break ;;
    esac
done

# ---- this machine's address ---------------------------------------------------------------------
detect_ip() {
    local ips
    if [[ -n $interface ]]; then
        ips=$(ip -4 -o addr show dev "$interface" 2>/dev/null | awk '{split($4, a, "/"); print a[1]}') || true
    else
        ips=$(hostname -I 2>/dev/null | tr ' ' '\n') || true
    fi
    grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' <<<"$ips" | grep -v -E '^(127\.|0\.0\.0\.0$)' | head -n1 || true
}
if [[ -z $node_ip ]]; then
    node_ip=$(detect_ip)
    [[ -n $node_ip ]] || die "cannot find this machine's IPv4 address${interface:+ on $interface}; pass --node-ip IP"
fi
[[ $node_ip != 0.0.0.0 ]] || die "--node-ip 0.0.0.0 is not an address other nodes can reach; give this machine's IP"
if [[ $print_ip == 1 ]]; then echo "$node_ip"; exit 0; fi

# ---- inputs, checked before anything starts ------------------------------------------------------
if [[ -n $spec && ! -f $spec ]]; then die "job spec '$spec' not found"; fi
if [[ $mode == join && ! $join_addr =~ ^[^:]+:[0-9]+$ ]]; then
    die "--join expects the head's HOST:PORT (e.g. 10.0.0.1:6379), got '$join_addr'"
fi
(( expect_nodes >= 1 )) || die "--expect-nodes must be at least 1"
(( port >= 1 && port <= 65535 )) || die "--port must be between 1 and 65535, got $port"
(( dashboard_port >= 1 && dashboard_port <= 65535 )) || die "--dashboard-port must be between 1 and 65535, got $dashboard_port"

find_cmd() {    # find_cmd NAME OVERRIDE: the override, NAME on PATH, or the repository's .venv/bin/NAME
    local name=$1 override=$2
    if [[ -n $override ]]; then
        command -v "$override" || die "$name command '$override' not found"
    elif command -v "$name" >/dev/null; then
        command -v "$name"
    elif [[ -x $HERE/../.venv/bin/$name ]]; then
        echo "$HERE/../.venv/bin/$name"
    else
        die "'$name' not found on PATH; activate msinfer's environment (source .venv/bin/activate) or set ${name^^}=/path/to/$name"
    fi
}
ray_cmd=$(find_cmd ray "${RAY:-}")
msinfer_cmd=""
if [[ -n $spec ]]; then msinfer_cmd=$(find_cmd msinfer "${MSINFER:-}"); fi

# Ray 2.60 sends its token to an explicit address only in token mode, so every node and the job run
# in token mode with the user's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} && ! -s ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} ]]; then
    if [[ $mode == head ]]; then
        "$ray_cmd" get-auth-token --generate >/dev/null 2>&1 || die "cannot create a Ray token (ray get-auth-token --generate)"
        say "created a Ray token in ~/.ray/auth_token: every node of this cluster needs the same one"
    else
        die "no Ray token here: copy the head's ~/.ray/auth_token to this machine, or set RAY_AUTH_TOKEN as on the head"
    fi
fi

# The node's workers keep the jemalloc Ray starts its own processes with (launcher/replica.py,
# WORKER_ALLOCATOR_ENV: graphs compile about a fifth faster); 0 keeps glibc's malloc for them.
export RAY_LD_PRELOAD_ON_WORKERS=${RAY_LD_PRELOAD_ON_WORKERS:-1}
# No worker processes started ahead of the actors (launcher/replica.py, LEAN_RAY_ENV): Ray starts
# one per CPU as a job's driver connects, each importing Ray and idle for the job's whole run
# where the job's ranks are fewer than the node's CPUs.
export RAY_prestart_worker_first_driver=${RAY_prestart_worker_first_driver:-0}

if [[ $mode == head ]]; then address=$node_ip:$port role=head; else address=$join_addr role=worker; fi
[[ -n $log ]] || log=${TMPDIR:-/tmp}/msinfer-node.$(hostname -s).$$.log
mkdir -p "$(dirname "$log")" || die "cannot create the folder of --log '$log'"

# ---- start this machine's Ray node ---------------------------------------------------------------
ray_pid=""
# shellcheck disable=SC2317  # stop_node and on_exit run from traps
stop_node() {
    if [[ -z $ray_pid ]] || ! kill -0 "$ray_pid" 2>/dev/null; then return 0; fi
    say "stopping the Ray node on $node_ip"
    kill -TERM "$ray_pid" 2>/dev/null || true
    local ticks=0                      # of 0.2 s
    while kill -0 "$ray_pid" 2>/dev/null && (( ticks < 300 )); do sleep 0.2; ticks=$((ticks + 1)); done
    if kill -0 "$ray_pid" 2>/dev/null; then
        kill -KILL "$ray_pid" 2>/dev/null || true
        say "warning: the Ray node did not stop within 60 s; some of its processes may remain (see $log)"
    fi
    wait "$ray_pid" 2>/dev/null || true
    ray_pid=""
}
# shellcheck disable=SC2317
on_exit() {
    local rc=$?
    trap - EXIT INT TERM HUP PIPE
    stop_node
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
trap 'exit 141' PIPE

start_args=(start --block --node-ip-address="$node_ip" --disable-usage-stats)
if [[ $mode == head ]]; then
    start_args+=(--head --port="$port")
    if [[ $dashboard == 1 ]]; then
        start_args+=(--include-dashboard=true --dashboard-host="$node_ip" --dashboard-port="$dashboard_port")
    else
        start_args+=(--include-dashboard=false)
    fi
else
    start_args+=(--address="$join_addr")
fi
python_cmd=$(dirname "$ray_cmd")/python
[[ -x $python_cmd ]] || python_cmd=python3
if [[ -z $num_cpus && $mode == head && -n $spec && $expect_nodes == 1 ]]; then
    # One machine for the job: as many CPU slots as its workers ask for where that is more than the
    # cores (Ray's CPUs are slots, not cores), as msinfer's embedded Ray gives them; a tp 3 job on
    # a 2-core machine would otherwise wait for a node with 3. A spec that does not load: none set
    # here, and `msinfer run` says what is wrong with it.
    sets=()
    for ((i = 0; i + 1 < ${#run_args[@]}; i++)); do
        [[ ${run_args[i]} == --set ]] && sets+=("${run_args[i + 1]}")
    done
    num_cpus=$("$python_cmd" - "$spec" ${sets[@]+"${sets[@]}"} 2>/dev/null <<'PY'
import math, os, sys
from msinfer.launcher.spec import load_spec
s = load_spec(sys.argv[1], sys.argv[2:])
p = s.parallel
workers = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
print(max(os.cpu_count() or 1, math.ceil(workers * s.ray.num_cpus_per_worker) + 1))
PY
) || num_cpus=""
fi
[[ -z $num_cpus ]] || start_args+=(--num-cpus="$num_cpus")
[[ -z $npus ]] || start_args+=(--resources="{\"NPU\": $npus}")
[[ -z $temp_dir ]] || start_args+=(--temp-dir="$temp_dir")
start_args+=(${ray_args[@]+"${ray_args[@]}"})

say "starting a Ray $role node on $node_ip$([[ $mode == join ]] && echo " (head $join_addr)"); its log: $log"
"$ray_cmd" "${start_args[@]}" >"$log" 2>&1 </dev/null &
ray_pid=$!

ticks=0                                # of 0.2 s
until grep -q "Ray runtime started" "$log" 2>/dev/null; do
    if ! kill -0 "$ray_pid" 2>/dev/null; then
        wait "$ray_pid" 2>/dev/null || true
        ray_pid=""
        tail -n 15 "$log" >&2 || true
        die "the Ray $role node did not start (last lines of $log above)"
    fi
    if (( ticks >= timeout * 5 )); then
        tail -n 5 "$log" >&2 || true
        die "the Ray $role node was not up after ${timeout} s$([[ $mode == join ]] && echo "; is a head listening at $join_addr?")"
    fi
    sleep 0.2; ticks=$((ticks + 1))
done
say "ready: Ray $role node on $node_ip, cluster address $address"
if [[ $mode == head && -z $spec ]]; then
    say "other machines join with: $PROG --join $address"
    if [[ $dashboard == 1 ]]; then
        say "jobs go to: ray job submit --address http://$node_ip:$dashboard_port -- ..."
    fi
fi

# ---- the job, or serve until stopped -------------------------------------------------------------
if [[ -z $spec ]]; then
    wait "$ray_pid" && rc=0 || rc=$?
    ray_pid=""
    (( rc == 0 )) || say "the Ray node exited with status $rc (see $log)"
    exit "$rc"
fi

if (( expect_nodes > 1 )); then
    say "waiting for $expect_nodes nodes in the cluster at $address"
    "$python_cmd" - "$address" "$expect_nodes" "$timeout" <<'PY' || die "fewer than $expect_nodes nodes joined $address within ${timeout} s"
import sys, time
import ray
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
end = time.monotonic() + timeout
while (alive := sum(1 for n in ray.nodes() if n["Alive"])) < want and time.monotonic() < end:
    time.sleep(0.25)
print(f"{alive} node(s) alive", file=sys.stderr)
sys.exit(0 if alive >= want else 1)
PY
fi

say "running: msinfer run $spec --set ray.address=$address ${run_args[*]-}"
# The job runs in the background so that a signal to this script reaches it at once (bash holds a
# trapped signal until its foreground child exits): SIGTERM and SIGUSR1 drain the job (exit 75),
# a second stops it, SIGINT interrupts it, and the script exits with the job's code. Job control
# (set -m) keeps the background job from starting with SIGINT ignored.
set -m
"$msinfer_cmd" run "$spec" --set "ray.address=$address" ${run_args[@]+"${run_args[@]}"} &
job_pid=$!
set +m
forward() { kill -s "$1" "$job_pid" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT
trap 'forward HUP' HUP
while kill -0 "$job_pid" 2>/dev/null; do wait "$job_pid" || true; done
wait "$job_pid" && rc=0 || rc=$?
exit "$rc"
