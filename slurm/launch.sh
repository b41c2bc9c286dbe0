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
# SIGUSR1 (the batch step's warning before the time limit, relayed by srun) goes to the trainer
# processes, which checkpoint at the next step boundary and exit; torchrun then exits 0. It is not sent
# to torchrun itself: torchrun does not handle SIGUSR1 and would die of it, and it starts its workers in
# their own sessions, so the signal has to be delivered to them by pid.
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
# A port per job, so jobs sharing a node do not collide.
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
echo "[launch] node ${SLURM_NODEID}/${SLURM_NNODES} ($(hostname)): ${GPUS_PER_NODE} ranks, rendezvous ${head_node}:${port}"

"$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "$head_node" --master-port "$port" -m "$@" &
torchrun_pid=$!

forward_to_trainers() {
  echo "[launch] node ${SLURM_NODEID}: SIGUSR1 -> trainer processes (checkpoint at the next step, then exit)"
  pkill -USR1 -P "$torchrun_pid" || true
}
trap forward_to_trainers USR1
wait_for_child "$torchrun_pid"
