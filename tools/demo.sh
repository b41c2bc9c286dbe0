#!/usr/bin/env bash
# The main job on embedded defaults, from a fresh machine: sets up .venv on first use, builds the demo's
# base policy once (tools/make_demo_base.py, ~1 minute), then trains it with DAPO on CPU: real
# megatron-core, a real SGLang engine, dynamic sampling, the token-level loss, overlong shaping.
# Extra arguments are Hydra overrides (e.g. `bash tools/demo.sh trainer.total_steps=50`). NPROC=2 runs
# the trainer as 2 processes under torchrun; add parallel=tp2 or parallel=pp2 to split the model.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$repo/tools/setup_env.sh")
cd "$repo"
# One thread each for the engine and the trainer while both compute (more would oversubscribe the two cores);
# the trainer takes every core while the engine is idle (trainer.cpu_idle_cores), the engine every core while
# the trainer only waits for it at larger sizes (rollout.cpu_idle_cores: off in the demo, see its config).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
base=outputs/demo_base
if [ ! -f "$base/config.json" ]; then
  "$python" tools/make_demo_base.py --output "$base" --force
fi
nproc=${NPROC:-1}
if [ "$nproc" -gt 1 ]; then
  exec "$python" -m torch.distributed.run --nproc-per-node "$nproc" -m dapo_megatron.train experiment=demo "$@"
fi
exec "$python" -m dapo_megatron.train experiment=demo "$@"
