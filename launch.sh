#!/usr/bin/env bash
# torchrun launcher shared by run_ddp.sh, run_fsdp.sh, run_pippy.sh and run_tp.sh:
# `bash launch.sh SCRIPT [flags]`.
#
# One node (the default):  NPROC_PER_NODE=4 bash run_ddp.sh --epochs 3
# Several nodes: on each node, with the same MASTER_ADDR (node 0's address) and MASTER_PORT:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 1
#
# NPROC_PER_NODE  processes on this node (default: the GPUs torch sees, which honours
#                 CUDA_VISIBLE_DEVICES; 2 without GPUs)
# NNODES          number of nodes (default 1: torchrun --standalone)
# NODE_RANK       this node's index, 0..NNODES-1; node 0 hosts the rendezvous (default 0), whose
#                 ranks torchrun deals to the nodes in an order of its own (rank 0 on any node)
# MASTER_ADDR     node 0's address (required with NNODES > 1); MASTER_PORT its port (default 29500)
# RDZV_ID         the job's name in the rendezvous, the same on every node (default babycnn)
# JOIN_TIMEOUT    seconds a node waits for the others before it gives up (default 600, torchrun's
#                 own: the nodes of one job can start minutes apart); nodes other than 0 first
#                 wait that long for node 0
# MAX_RESTARTS    times torchrun restarts all workers after one fails (default 0 on one node, 3 on
#                 several); with --checkpoint-dir the restarted workers resume from the last
#                 checkpoint
# OMP_NUM_THREADS CPU threads per process (default: this machine's cores / NPROC_PER_NODE, at
#                 least 1)
# FLIGHT_RECORDER_DIR where NCCL's flight recorder dumps go when a collective times out (default
#                 ./flight_recorder; said on the torchrun line on a GPU node)
# A bad value stops the launch at once with one `error:` line and exit code 2; so does
# NPROC_PER_NODE past what this node's memory holds (850 MB each); more than its cores is a
# one-line warning.
#
# Under a PyTorchJob with an elasticPolicy (Kubeflow's Training Operator, k8s/), the operator sets
# torchrun's own variables instead (PET_NNODES=MIN:MAX, PET_RDZV_ENDPOINT, PET_RDZV_ID,
# PET_RDZV_CONF, PET_MAX_RESTARTS), and torchrun reads them itself: NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT, RDZV_ID, JOIN_TIMEOUT and MAX_RESTARTS are not used. NPROC_PER_NODE is: its
# --nproc-per-node outranks the operator's PET_NPROC_PER_NODE.
#
# A stop signal to torchrun (plumbing/failures.py's STOP_SIGNALS: SIGTERM, SIGINT, SIGUSR1,
# SLURM's warning before a time limit, SIGHUP, SIGQUIT): it passes the signal on, the workers stop
# together within about a second of training and write a checkpoint (with --checkpoint-dir), and
# the launch ends with exit code 128 + the signal's number (143, 130, 138, 129, 131), which
# schedulers read as "preempted". A second signal over 2 s later ends it at once (within 2 s: the
# same stop, as GNU timeout and scancel send it to several processes); one during start-up is one
# line; one after the last step lets the run finish (exit code 0). A failed launch ends in one
# line, not torchrun's traceback: exit code 2 for a bad input or a bug the workers found (not
# restarted), 75 for a failure that may pass on a retry (a peer lost: restarted while MAX_RESTARTS
# allows, each restart said in one line), 1 for a crash, 128 + the signal for a rank a signal ended
# (launch_torchrun.py says more).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
script=${1:-}
[[ $script = /* ]] || script="$here/$script"  # beside this file, or anywhere by its full path
shift || true
if [ ! -f "$script" ]; then
    echo "error: no training script $script:" \
        "use run_ddp.sh, run_fsdp.sh, run_pippy.sh or run_tp.sh" \
        "(or bash launch.sh train_ddp.py|train_fsdp.py|train_pippy.py|train_tp.py)" >&2
    exit 2
fi
for flag in "$@"; do  # one process prints the help, not one per worker
    if [ "$flag" = --help ] || [ "$flag" = -h ]; then exec python3 "$script" --help; fi
done

# check NAME MIN MAX ALLOWED: $NAME must be a whole number from MIN to MAX. Checked here, one line
# each: later a bad value gives torchrun's bare AssertionError (0 processes) or bash's "unbound
# variable" (a word).
check() {
    local value=${!1}
    if [[ ! $value =~ ^(0|[1-9][0-9]{0,8})$ ]] || (( value < $2 || value > $3 )); then
        echo "error: $1 must be $4, got '$value'" >&2
        exit 2
    fi
}
# set by the Training Operator: torchrun takes the layout from PET_* itself
elastic=${PET_RDZV_ENDPOINT:+1}
if [ -z "$elastic" ]; then
    NNODES=${NNODES:-1}
    check NNODES 1 999999999 "a positive integer (the number of nodes)"
    NODE_RANK=${NODE_RANK:-0}
    check NODE_RANK 0 $((NNODES - 1)) "0 to $((NNODES - 1)) with NNODES=$NNODES"
    if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
        # A default of 127.0.0.1 would have every node wait for itself until the rendezvous times
        # out.
        echo "error: NNODES=$NNODES needs MASTER_ADDR, node 0's address, the same on every node" \
            "(e.g. MASTER_ADDR=node0 MASTER_PORT=29500)" >&2
        exit 2
    fi
    MASTER_PORT=${MASTER_PORT:-29500}
    check MASTER_PORT 1 65535 "a port number, 1 to 65535"
    if [ "$NNODES" -eq 1 ]; then
        MAX_RESTARTS=${MAX_RESTARTS:-0}
    else
        MAX_RESTARTS=${MAX_RESTARTS:-3}
    fi
    check MAX_RESTARTS 0 999999999 "an integer, 0 or more"
    JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}
    check JOIN_TIMEOUT 1 999999999 "a positive integer (seconds)"
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
    # Count the GPUs torch will see: nvidia-smi lists every GPU, also those CUDA_VISIBLE_DEVICES
    # hides. Without a GPU device file there are none, and no need to spend seconds importing torch
    # to learn it.
    gpus=0
    if compgen -G "/dev/nvidia[0-9]*" > /dev/null || [ -e /dev/kfd ]; then
        gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    fi
    if [ "$gpus" -gt 0 ]; then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi
check NPROC_PER_NODE 1 999999999 "a positive integer (processes on this node)"
# Each worker holds torch, its CUDA or CPU runtime and the data set in host memory: 0.85 GB at its
# peak for train_ddp.py on MNIST (2 CPU processes, measured). More than fit would start, then die
# one by one, out of memory. MemAvailable is Linux's: elsewhere there is no check.
available_mb=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo 2>/dev/null || true)
if [ -n "$available_mb" ] && (( NPROC_PER_NODE * 850 > available_mb )); then
    echo "error: NPROC_PER_NODE=$NPROC_PER_NODE processes need about" \
        "$((NPROC_PER_NODE * 850)) MB of memory (850 MB each), but this node has" \
        "$available_mb MB available: start at most $((available_mb / 850))" >&2
    exit 2
fi
# nproc counts the cores this process may use (but reports OMP_NUM_THREADS when set); macOS has
# getconf only.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
if (( NPROC_PER_NODE > cores )); then
    echo "launch.sh: warning: NPROC_PER_NODE=$NPROC_PER_NODE processes share this node's" \
        "$cores cores:" \
        "each waits for the others (use at most $cores for speed)" >&2
fi

# NCCL: a collective stuck on a dead or hung peer ends the process after the process group's
# timeout (the watchdog, mode 3: torch's default, and torchtitan's; mode 1 aborted before the dump
# was written, pytorch issue 121055), first writing each rank's flight recorder (its last
# collectives) to FLIGHT_RECORDER_DIR/rank_<RANK> (default: ./flight_recorder, where the job
# started: not a node's own /tmp); torchrun then restarts or ends the job, and launch_torchrun.py
# says which collective timed out.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
dumps=${FLIGHT_RECORDER_DIR:-flight_recorder}
[[ $dumps = /* ]] || dumps="$PWD/$dumps"  # the workers' own path, wherever they start
# the files' prefix, under its older name too (older releases read that one)
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$dumps/rank_}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$TORCH_FR_DUMP_TEMP_FILE
dumps=""  # said on the torchrun line where NCCL runs (a GPU here), and made there
if compgen -G "/dev/nvidia[0-9]*" > /dev/null; then
    dumps=$(dirname "$TORCH_FR_DUMP_TEMP_FILE")
    mkdir -p "$dumps" || true
fi

# torchrun would set 1 thread per process with a warning; use the cores this node really has
# instead.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    threads=$(( cores / NPROC_PER_NODE ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
# torchrun (launch_torchrun.py) passes the stop signals on to the workers, then gives them 30 s
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, from torch 2.10) to write their checkpoint before it kills them.

# The torchrun below is this function: torchrun's own code, all output passing through, but a launch
# that fails ends in one line instead of torchrun's 40- to 80-line traceback (launch_torchrun.py
# says how each ending reads). Copied elsewhere, the command lines work as they are with the real
# torchrun.
torchrun() {
    local line
    # the operator's variables, not ours; torchrun's defaults where unset
    if [ -n "$elastic" ]; then
        local nnodes=${PET_NNODES:-1} wait="torchrun's default join_timeout, 600 s"
        if [[ ,${PET_RDZV_CONF:-}, =~ ,join_timeout=([^,]+), ]]; then
            wait="join_timeout=${BASH_REMATCH[1]} s (PET_RDZV_CONF)"
        fi
        if [ -z "${PET_NNODES:-}" ]; then
            line="error: not all nodes (PET_NNODES unset: 1) joined"
        elif [ "${nnodes%%:*}" != "${nnodes#*:}" ]; then  # MIN:MAX: it waits for MIN
            line="error: fewer than ${nnodes%%:*} nodes (PET_NNODES=$nnodes) joined"
        else
            line="error: not all PET_NNODES=${nnodes%%:*} nodes joined"
        fi
        line+=" at PET_RDZV_ENDPOINT=$PET_RDZV_ENDPOINT within $wait:"
        line+=" are the other pods running and able to reach it?"
    else
        line="error: not all NNODES=$NNODES nodes joined at ${endpoint:-localhost} within"
        line+=" JOIN_TIMEOUT=$JOIN_TIMEOUT s: start each with the same MASTER_ADDR, MASTER_PORT and"
        line+=" RDZV_ID, or raise JOIN_TIMEOUT"
    fi
    # At once: torch takes seconds to import before anything else is said.
    echo "launch.sh: torchrun $*${dumps:+ (flight recorder dumps on an NCCL timeout: $dumps)}" >&2
    # The line for a rendezvous that times out, in the environment: argv is torchrun's own.
    export LAUNCH_SH_NO_RENDEZVOUS=$line
    exec python3 "$here/launch_torchrun.py" "$@"
}

if [ -n "$elastic" ]; then
    # The nodes meet at PET_RDZV_ENDPOINT (the first pod's service); torchrun reads the PET_*
    # variables itself.
    torchrun --nproc-per-node="$NPROC_PER_NODE" "$script" "$@"
fi
if [ "$NNODES" -eq 1 ]; then
    # --standalone: a private rendezvous on a free local port, no address to agree on.
    torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
        "$script" "$@"
fi

# Several nodes: what torchrun would report in a 40- to 80-line traceback, or not at all for 10
# minutes, is checked here first and said in one line.
endpoint=$MASTER_ADDR:$MASTER_PORT
if [ "$NODE_RANK" -eq 0 ]; then
    # Node 0 hosts the rendezvous store on MASTER_PORT: is the port free here?
    if ! why=$(python3 -c 'import socket, sys
s = socket.socket()
# as the store does: a port in TIME_WAIT is free
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    sys.exit(e.strerror)' "$MASTER_PORT" 2>&1); then
        echo "error: node 0 cannot listen on MASTER_PORT=$MASTER_PORT ($why):" \
            "pick another MASTER_PORT, the same on every node" >&2
        exit 2
    fi
    others=$([ "$NNODES" -eq 2 ] && echo "node 1" || echo "nodes 1 to $((NNODES - 1))")
    echo "node 0 of $NNODES: waiting up to JOIN_TIMEOUT=$JOIN_TIMEOUT s at $endpoint" \
        "for $others to join" >&2
else
    # Wait for node 0, however late it starts: torchrun alone gives up after a minute, in some 80
    # lines.
    echo "node $NODE_RANK of $NNODES: waiting up to JOIN_TIMEOUT=$JOIN_TIMEOUT s" \
        "for node 0 at $endpoint" >&2
    local_addr=$(python3 - "$MASTER_ADDR" "$MASTER_PORT" "$JOIN_TIMEOUT" <<'PYTHON'
import socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    socket.getaddrinfo(host, port)
except socket.gaierror as e:
    sys.exit(f"error: MASTER_ADDR={host} does not resolve on this node ({e.strerror}):"
             " give node 0's address")
deadline = time.monotonic() + timeout
while True:
    try:
        with socket.create_connection((host, port), timeout=1) as node_0:
            print(node_0.getsockname()[0])  # this node's address that reached node 0
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"error: nothing answered at MASTER_ADDR:MASTER_PORT={host}:{port} within"
                     f" JOIN_TIMEOUT={timeout} s: start node 0 with the same MASTER_ADDR and"
                     " MASTER_PORT, or raise JOIN_TIMEOUT")
        time.sleep(1)
PYTHON
) || exit 2
fi

# c10d rendezvous: every node meets at MASTER_ADDR:MASTER_PORT; node 0 hosts its store. It numbers
# the nodes itself (by address: rank 0 may be on any node; --node-rank is for the static
# rendezvous, and torch 2.14 warns that it ignores it), and the workers dial rank 0's node at its
# --local-addr: node 0's is MASTER_ADDR, the others' the address that reached node 0 above (not
# each node's own hostname, which may not resolve or may name another network).
is_host=$([ "$NODE_RANK" -eq 0 ] && echo 1 || echo 0)
torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="${RDZV_ID:-babycnn}" \
    --rdzv-conf="is_host=$is_host,join_timeout=$JOIN_TIMEOUT" \
    --local-addr="${local_addr:-$MASTER_ADDR}" "$script" "$@"
