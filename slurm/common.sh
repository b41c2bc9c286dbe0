# shellcheck shell=bash
# Helpers shared by slurm/job.sh and slurm/launch.sh.

# Wait for child `pid` and return its exit status. A trapped signal interrupts bash's `wait` (which
# then returns 128+signal); the trap has run, so keep waiting for the child's real exit.
wait_for_child() {
  local pid=$1
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid" || true
  done
  # bash keeps the status of a child it has reaped; this returns it.
  wait "$pid"
}
