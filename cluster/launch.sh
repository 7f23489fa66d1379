#!/usr/bin/env bash
# Launch a recipe with torchrun on this node, after pre-flight checks; run it once per node.
#
#   cluster/launch.sh <recipe> [nnodes] [node_rank] [master_addr] [master_port] [-- hydra overrides]
#
#   cluster/launch.sh fashion_mnist                                     # this machine, all GPUs
#   cluster/launch.sh timm_imagenet 2 0 10.0.0.1 29500 -- trainer.epochs=90   # on node 0
#   cluster/launch.sh timm_imagenet 2 1 10.0.0.1 29500 -- trainer.epochs=90   # on node 1
#
# Every node gives the same nnodes, master_addr, master_port and overrides; node 0 hosts the
# c10d rendezvous at master_addr:master_port. Defaults: 1 node, rank 0, 127.0.0.1, 29500.
#
# Variables:
#   NPROC_PER_NODE   processes on this node (default: the number of GPUs, else 1)
#   BACKEND          nccl or gloo (default: nccl with GPUs, else gloo); gloo also adds device=cpu
#   LOG_LEVEL        torchrun's log level: DEBUG, INFO, WARNING (default), ERROR; DEBUG also
#                    sets TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=INFO
#   LOG_DIR          where the per-node logs go (default: logs); each launch writes
#                    <recipe>-<date>-<time>-node<k>.log and points latest_node<k>.log at it
#   CONNECT_TIMEOUT  seconds to wait for the master and for the rendezvous (default 300)
#   RUN_ID           rendezvous id, the same on every node (default: the recipe name)
#   PYTHON           interpreter (default: .venv/bin/python, else python3)
#
# Before torchrun starts, each node checks (one clear line and exit 1 on failure): the Python
# environment imports the recipe, the GPU count and free memory, the config resolves with the
# overrides, the master port is free (node 0) or reachable over TCP (other nodes), and a
# small all-reduce across all ranks of all nodes succeeds. torchrun runs through cluster/torchrun.py:
# SIGTERM or SIGUSR1 to this script reach it, it forwards them to the workers, they checkpoint,
# and the script exits with code 75 (TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long the workers get to
# checkpoint, 120 s by default).
set -euo pipefail

die() {
    echo "error: $*" >&2
    exit 1
}

usage() {
    echo "usage: $0 <recipe> [nnodes] [node_rank] [master_addr] [master_port] [-- hydra overrides]" >&2
    exit 2
}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

positional=()
while [[ $# -gt 0 && $1 != -- ]]; do
    positional+=("$1")
    shift
done
if [[ $# -gt 0 ]]; then shift; fi
overrides=("$@")
[[ ${#positional[@]} -ge 1 && ${#positional[@]} -le 5 ]] || usage
recipe=${positional[0]}
nnodes=${positional[1]:-1}
node_rank=${positional[2]:-0}
master_addr=${positional[3]:-127.0.0.1}
master_port=${positional[4]:-29500}
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "nnodes must be a positive integer, not '$nnodes'"
[[ $node_rank =~ ^[0-9]+$ && $node_rank -lt $nnodes ]] || die "node_rank must be in 0..$((nnodes - 1)), not '$node_rank'"
[[ $master_port =~ ^[0-9]+$ && $master_port -gt 0 && $master_port -lt 65536 ]] ||
    die "master_port must be a TCP port number, not '$master_port'"
[[ -f recipes/$recipe/train.py ]] || die "unknown recipe '$recipe' (recipes/$recipe/train.py not found)"

PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=$(command -v python3) || die "no Python found: run 'make setup' or set PYTHON"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}
if [[ -z ${BACKEND:-} ]]; then
    if ((gpus > 0)); then BACKEND=nccl; else BACKEND=gloo; fi
fi
[[ $BACKEND == nccl || $BACKEND == gloo ]] || die "BACKEND must be nccl or gloo, not '$BACKEND'"
[[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, not '$NPROC_PER_NODE'"
if [[ $BACKEND == gloo ]]; then
    overrides=(device=cpu "${overrides[@]}")
fi

LOG_LEVEL=${LOG_LEVEL:-WARNING}
export LOGLEVEL=$LOG_LEVEL
if [[ $LOG_LEVEL == DEBUG ]]; then
    export TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO
fi
CONNECT_TIMEOUT=${CONNECT_TIMEOUT:-300}
RUN_ID=${RUN_ID:-$recipe}

LOG_DIR=${LOG_DIR:-logs}
mkdir -p "$LOG_DIR"
log_name=$recipe-$(date +%Y%m%d-%H%M%S)-node$node_rank.log
ln -sfn "$log_name" "$LOG_DIR/latest_node$node_rank.log"
exec > >(tee -a "$LOG_DIR/$log_name") 2>&1
echo "launch: $recipe, node $node_rank of $nnodes, $NPROC_PER_NODE process(es) ($BACKEND), master $master_addr:$master_port," \
    "log $LOG_DIR/$log_name"

"$PYTHON" -m cluster.preflight node --recipe "$recipe" --nnodes "$nnodes" --node-rank "$node_rank" \
    --master-addr "$master_addr" --master-port "$master_port" --nproc-per-node "$NPROC_PER_NODE" \
    --backend "$BACKEND" --connect-timeout "$CONNECT_TIMEOUT" -- "${overrides[@]}" || exit 1

is_host=$((node_rank == 0 ? 1 : 0))
torchrun=("$PYTHON" -m cluster.torchrun --nnodes "$nnodes" --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
    --rdzv-conf "is_host=$is_host,join_timeout=$CONNECT_TIMEOUT")
if ! preflight_output=$("${torchrun[@]}" --rdzv-id "$RUN_ID-preflight" -m cluster.preflight allreduce \
    --backend "$BACKEND" --timeout "$CONNECT_TIMEOUT" 2>&1); then
    echo "$preflight_output" | tail -n 20
    die "the all-reduce across $((nnodes * NPROC_PER_NODE)) ranks failed (output above; LOG_LEVEL=DEBUG for more)"
fi
echo "$preflight_output"

exec "${torchrun[@]}" --rdzv-id "$RUN_ID" -m "recipes.$recipe.train" "${overrides[@]}"
