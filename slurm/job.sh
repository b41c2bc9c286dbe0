#!/usr/bin/env bash
# The batch step shared by the slurm/*.sbatch recipes: one launcher per node through srun (in the
# container when CONTAINER_IMAGE is set), and the time-limit protocol (slurm/README.md):
#   sbatch --signal=B:USR1@N  ->  this script relays SIGUSR1 to the job step through srun, which signals
#   every process of the step  ->  each node's launcher creates its stop file (the rest ignore the signal)
#   ->  the trainers checkpoint at their next step boundary and exit 0  ->  this script requeues the job
#   ->  the restart resumes from the checkpoint (trainer.resume=auto, the default).
#
#   bash slurm/job.sh PYTHON_MODULE [ARGS...]      (from an sbatch script, submitted from the repo root)
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?submit with sbatch from the repository root}"
# shellcheck source=slurm/env.sh
source "${DAPO_SLURM_ENV:-slurm/env.sh}"
# shellcheck source=slurm/common.sh
source slurm/common.sh
echo "[job] ${SLURM_JOB_NAME:-?} ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}," \
     "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown): $*"

container=()
if [ -n "$CONTAINER_IMAGE" ]; then
  container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
             --container-workdir="$PWD" --no-container-mount-home)
fi
stop_requested=0
srun_pid=""
# shellcheck disable=SC2329  # called by the USR1 trap
relay_stop() {
  stop_requested=1
  echo "[job] time limit near: asking the trainers to checkpoint and stop"
  kill -USR1 "$srun_pid" 2>/dev/null || true
}
trap relay_stop USR1

# srun relays the signals it receives to every process of the step; --kill-on-bad-exit stops all nodes
# when one fails; --label prefixes every output line with its node's task number ("3: ...").
srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label "${container[@]}" bash slurm/launch.sh "$@" &
srun_pid=$!
status=0
wait_for_child "$srun_pid" || status=$?
if [ "$stop_requested" = 1 ] && [ "$status" = 0 ]; then
  echo "[job] checkpoint written; requeueing. The restart resumes from it."
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
