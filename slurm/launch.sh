#!/usr/bin/env bash
# One launcher per node (srun --ntasks-per-node=1 runs this on every node of the allocation): torchrun
# starts GPUS_PER_NODE ranks of `python -m MODULE ARGS...` here and meets the other nodes at RDZV_HOST, the
# first node of the allocation, which slurm/job.sh resolves and srun passes in with the environment.
#
#   slurm/launch.sh dapo_megatron.train experiment=dapo_qwen2.5_32b
#
# This runs inside the container, whose image has no Slurm client: it calls no Slurm command.
# Ranks are assigned node by node (static rendezvous: node i holds ranks i*GPUS_PER_NODE...), so tensor-
# parallel groups stay inside a node's NVLink domain.
#
# Slurm delivers a signal sent to a job step to every process of the step, not only this script:
# - SIGUSR1 (the time-limit warning, relayed by job.sh): everything started here inherits it ignored
#   (torchrun, the trainers, SGLang, reward workers: none may die of it); this script alone handles it, by
#   creating the stop file that the trainers check at each step boundary and while a step generates.
# - SIGTERM (slurmd ending the step: --kill-on-bad-exit after another node failed, `scancel --signal=TERM`,
#   the end of the job): torchrun passes it to the ranks and SIGKILLs them 30 s later; the trainers take it
#   as a request to checkpoint and stop (dapo_megatron/distributed/stop.py). This script creates the stop
#   file too, then keeps waiting for torchrun: once a step's task exits, slurmstepd SIGKILLs every process
#   the task leaves behind, which would end the ranks mid-checkpoint. At the end of a job, Slurm's own
#   SIGKILL follows KillWait seconds after its SIGTERM.
# The whole protocol: slurm/README.md.
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
: "${SLURM_NNODES:?}" "${SLURM_NODEID:?}"
: "${RDZV_HOST:?the rendezvous host (the first node) is unset: start this through slurm/job.sh, which sets it}"
# One port per job (jobs sharing a node do not collide), below Linux's ephemeral range (from 32768), where
# the kernel picks the local ports of outgoing connections. Same formula: distributed/launch.py.
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
echo "[launch] node ${SLURM_NODEID}/${SLURM_NNODES} (${HOSTNAME}): ${GPUS_PER_NODE} ranks, rendezvous ${RDZV_HOST}:${port}"

# Node-local and per run: a requeued job keeps its id and may come back to this node. TMPDIR may name a host
# directory that is not mounted into the container; /tmp is there in every image.
node_tmp=${TMPDIR:-/tmp}
if [ ! -d "$node_tmp" ] || [ ! -w "$node_tmp" ]; then
  node_tmp=/tmp
fi
export DAPO_STOP_FILE=$node_tmp/dapo_stop_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}_${SLURM_NODEID}
rm -f "$DAPO_STOP_FILE"

# The container gets no home directory (job.sh: --no-container-mount-home, so that ~/.local's packages do not
# shadow the image's), and $HOME then names a path the image lacks. What caches under it (flashinfer's and
# torch's compiled kernels) gets a node-local home instead of failing at its first write.
if [ ! -d "${HOME:-}" ] || [ ! -w "${HOME:-}" ]; then
  export HOME=$node_tmp/dapo_home_${SLURM_JOB_ID}_${SLURM_NODEID}
  mkdir -p "$HOME"
fi

# shellcheck disable=SC2329  # called by the traps
request_stop() {
  echo "[launch] node ${SLURM_NODEID}: SIG$1: the trainers checkpoint and exit (a generation is aborted," \
       "an update finishes)"
  touch "$DAPO_STOP_FILE" || echo "[launch] node ${SLURM_NODEID}: cannot create the stop file $DAPO_STOP_FILE"
}
# A trapped signal is reset to its default in the programs this script starts (torchrun installs its own
# SIGTERM handler); an ignored one stays ignored in them, hence SIGUSR1's handler comes after the start.
trap 'request_stop TERM' TERM
trap '' USR1
"$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "$RDZV_HOST" --master-port "$port" -m "$@" &
torchrun_pid=$!
trap 'request_stop USR1' USR1
status=0
wait_for_child "$torchrun_pid" || status=$?
rm -f "$DAPO_STOP_FILE"
exit "$status"
