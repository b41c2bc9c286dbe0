#!/usr/bin/env bash
# One launcher per node (srun --ntasks-per-node=1 runs this on every node of the allocation): torchrun
# starts GPUS_PER_NODE ranks of `python -m MODULE ARGS...` here and meets the other nodes at the first
# node of the allocation.
#
#   slurm/launch.sh dapo_megatron.train experiment=dapo_qwen2.5_32b
#
# Ranks are assigned node by node (static rendezvous: node i holds ranks i*GPUS_PER_NODE...), so tensor-
# parallel groups stay inside a node's NVLink domain.
#
# SIGUSR1 (the time-limit warning, relayed by srun) reaches every process of the job step, not only this
# script. Everything started here inherits it ignored (torchrun, the trainers, SGLang, reward workers:
# none may die of it); this script alone handles it, by creating the stop file that the trainers check at
# each step boundary. The whole protocol: slurm/README.md.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/env.sh
source "${DAPO_SLURM_ENV:-$here/env.sh}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
cd "$here/.."

if [ "$#" -lt 1 ]; then
  echo "usage: $0 PYTHON_MODULE [ARGS...]" >&2
  exit 2
fi
: "${SLURM_JOB_ID:?run under Slurm (srun), or set the SLURM_* variables}"
: "${SLURM_NNODES:?}" "${SLURM_NODEID:?}" "${SLURM_JOB_NODELIST:?}"
# sed, not head: head exits after one line and the writer's SIGPIPE would fail the pipeline (pipefail).
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
# One port per job (jobs sharing a node do not collide), below Linux's ephemeral range (from 32768), where
# the kernel picks the local ports of outgoing connections. Same formula: distributed/launch.py.
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
echo "[launch] node ${SLURM_NODEID}/${SLURM_NNODES} ($(hostname)): ${GPUS_PER_NODE} ranks, rendezvous ${head_node}:${port}"

# Node-local and per run: a requeued job keeps its id and may come back to this node.
export DAPO_STOP_FILE=${TMPDIR:-/tmp}/dapo_stop_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}_${SLURM_NODEID}
rm -f "$DAPO_STOP_FILE"

trap '' USR1  # ignored here while torchrun starts: it and everything it starts inherit "ignored"
"$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "$head_node" --master-port "$port" -m "$@" &
torchrun_pid=$!

# shellcheck disable=SC2329  # called by the USR1 trap
request_stop() {
  echo "[launch] node ${SLURM_NODEID}: SIGUSR1: the trainers checkpoint at the next step boundary and exit"
  touch "$DAPO_STOP_FILE"
}
trap request_stop USR1
status=0
wait_for_child "$torchrun_pid" || status=$?
rm -f "$DAPO_STOP_FILE"
exit "$status"
