#!/usr/bin/env bash
# The main job on embedded defaults, from a fresh machine: sets up .venv on first use, then trains
# the tiny policy on CPU with real megatron-core. Extra arguments are Hydra overrides
# (e.g. `bash tools/demo.sh warmup.max_steps=200`). Set NPROC=4 to run it as 4 processes with
# parallel=tp2pp2 (or any layout) under torchrun.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$repo/tools/setup_env.sh")
cd "$repo"
# Tiny matmuls on 2 cores: intra-op threads cost more than they save.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
nproc=${NPROC:-1}
if [ "$nproc" -gt 1 ]; then
  exec "$python" -m torch.distributed.run --nproc-per-node "$nproc" -m dapo_megatron.trainer.warmup "$@"
fi
exec "$python" -m dapo_megatron.trainer.warmup "$@"
