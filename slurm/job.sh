#!/usr/bin/env bash
# The batch step shared by the slurm/*.sbatch recipes: one launcher per node through srun (in the container
# when CONTAINER_IMAGE is set), and this script's half of the time-limit stop (slurm/README.md):
#   sbatch --signal=B:USR1@N  ->  this script relays SIGUSR1 to the job step through srun, which signals
#   every process of the step  ->  each node's launcher creates its stop file (the rest ignore the signal)
#   ->  the trainers checkpoint (at the next step boundary, or at once mid-generation) and exit 0  ->  this
#   script requeues the job
#   ->  the restart resumes from the newest complete checkpoint (trainer.resume=auto, the default).
# A SIGTERM (Slurm ending the job, or sent to this shell alone) is relayed the same way. After any relayed
# stop the job is requeued, whatever the step's exit status: it cannot go on in this allocation, and the
# restart resumes from the newest complete checkpoint. Except when Slurm is ending the job for another reason
# than its time limit (scancel, preemption): a requeue would bring a cancelled job back.
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

# The rendezvous host, the allocation's first node, is resolved here: the launchers run in the container,
# whose image has no Slurm client. srun passes this script's environment to every task (pyxis passes it into
# the container). sed, not head: head exits after one line and the writer's SIGPIPE would fail the pipeline.
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export RDZV_HOST

# Whether path $1 lies under one of the container paths of pyxis' --container-mounts $2 (SRC:DST[:FLAGS],...).
mounted() {
  local entry source target
  local -a entries
  IFS=, read -ra entries <<<"$2"
  for entry in "${entries[@]}"; do
    IFS=: read -r source target _ <<<"$entry"
    target=${target:-$source}
    target=${target%/}
    if [[ $1 == "$target" || $1 == "$target"/* ]]; then
      return 0
    fi
  done
  return 1
}

container=()
if [ -n "$CONTAINER_IMAGE" ]; then
  # Inside the container only the mounts exist: a path elsewhere would fail on every node once the image has
  # started, or be written where no other node, and not the host, sees it. The home directory stays out
  # (--no-container-mount-home): its ~/.local packages would shadow the image's.
  for arg in "$PWD" "$@"; do
    path=${arg#*=}  # a Hydra override's value
    if [[ $path == /* ]] && ! mounted "$path" "$CONTAINER_MOUNTS"; then
      top=${path#/}
      top=/${top%%/*}
      echo "[job] $arg: $path is not under CONTAINER_MOUNTS=$CONTAINER_MOUNTS, so the container cannot see" \
           "it; add its filesystem in slurm/env.sh, e.g. CONTAINER_MOUNTS=$CONTAINER_MOUNTS,$top:$top" >&2
      exit 2
    fi
  done
  container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
             --container-workdir="$PWD" --no-container-mount-home)
fi

stop_relayed=""  # the last signal this script relayed to the step as a stop request
requeue=""       # "requeued" or "declined" once decided
srun_pid=""

# Slurm ends a job by sending SIGCONT and SIGTERM to every process of it, this shell and srun included, then
# SIGKILL KillWait seconds later (slurm.conf, default 30). Beforehand slurmctld records why: `scontrol show
# job` says JobState=COMPLETING with Reason=TimeLimit at the time limit (Reason=None for scancel).
slurm_ending_reason() {
  local info
  info=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || return 0
  if [[ $info == *" JobState=COMPLETING "* && $info =~ " Reason="([^ ]*) ]]; then
    echo "${BASH_REMATCH[1]}"
  fi
  return 0
}

# $1: why Slurm is ending the job, when already asked.
requeue_job() {
  [ -z "$requeue" ] || return 0
  local reason
  if [ "$#" -gt 0 ]; then reason=$1; else reason=$(slurm_ending_reason); fi
  if [ -n "$reason" ] && [ "$reason" != TimeLimit ]; then
    # scontrol requeue also takes a job Slurm is ending, so a cancelled job would come back.
    requeue=declined
    echo "[job] Slurm is ending the job (Reason=$reason: scancel or preemption), not its time limit: no requeue"
    return 0
  fi
  requeue=requeued
  echo "[job] stopped (SIG$stop_relayed); requeueing: the restart resumes from the newest complete checkpoint"
  scontrol requeue "$SLURM_JOB_ID" \
    || echo "[job] scontrol requeue failed: resubmit this recipe; it resumes from the newest complete checkpoint"
}

# shellcheck disable=SC2329  # called by the traps
relay_stop() {
  # A requeue of a running job makes Slurm end it, this shell included: nothing more to relay.
  [ "$requeue" != requeued ] || return 0
  stop_relayed=$1
  echo "[job] SIG$1: asking the trainers to checkpoint and stop"
  # Always as SIGUSR1: srun passes SIGUSR1 on to every process of the step, but answers SIGTERM with SIGKILL
  # to the whole step ("forcing job termination").
  if [ -n "$srun_pid" ]; then
    kill -USR1 "$srun_pid" 2>/dev/null || true
  fi
  # When Slurm ends the job, srun got the SIGTERM too and has killed the step, and SIGKILL comes KillWait
  # seconds after: requeue now, within that window, not once the step is gone.
  if [ "$1" = TERM ]; then
    local reason
    reason=$(slurm_ending_reason)
    if [ -n "$reason" ]; then
      requeue_job "$reason"
    fi
  fi
}
trap 'relay_stop USR1' USR1
trap 'relay_stop TERM' TERM

status=0
if [ -z "$stop_relayed" ]; then
  # srun relays the signals it receives to every process of the step (SIGTERM as SIGKILL, above);
  # --kill-on-bad-exit ends every node's processes when one node's task fails (SIGTERM, then SIGKILL after
  # KillWait); --label prefixes every output line with its node's task number ("3: ...").
  srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label "${container[@]}" bash slurm/launch.sh "$@" &
  srun_pid=$!
  wait_for_child "$srun_pid" || status=$?
fi
if [ -n "$stop_relayed" ]; then
  requeue_job
fi
exit "$status"
