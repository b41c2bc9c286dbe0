# shellcheck shell=bash
# The one file to edit for your cluster: container, mounts, NCCL/CUDA settings, paths. Sourced by
# slurm/job.sh (the batch step) and slurm/launch.sh (every node); values already in the environment win,
# so `GPUS_PER_NODE=4 sbatch ...` works without editing.

# --- container (pyxis/enroot) ---
# NVIDIA's PyTorch container plus this project's requirements (README, "Clusters": build it once with
# `srun --container-image=... --container-save=...`). Empty: run without a container (a prepared venv).
export CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
# The repository, data, checkpoints and caches must be on a shared filesystem mounted at the same path.
export CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-/lustre:/lustre}
export PYTHON=${PYTHON:-python}

# --- layout and caches (checkpoints and TensorBoard go to the recipe's output_dir, relative to the repo) ---
# Trainer ranks per node; by default the GPUs Slurm gave this node (--gpus-per-node).
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export HF_HOME=${HF_HOME:-$PWD/.cache/huggingface}

# --- CUDA / PyTorch ---
# One hardware queue orders megatron's tensor-parallel communication and compute kernels.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1
# Per-node Triton cache: a shared-filesystem cache makes every rank fight over the same files.
export TRITON_CACHE_DIR=/tmp/triton_cache_${SLURM_JOB_ID:-0}_${SLURM_NODEID:-0}

# --- NCCL on H100 InfiniBand ---
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# With NCCL_DEBUG=INFO, say which interfaces and settings were picked.
export NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,ENV}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}
export NCCL_P2P_NET_CHUNKSIZE=${NCCL_P2P_NET_CHUNKSIZE:-2097152}
# Cluster-specific; uncomment and set from `ibstat` / `ip link` on a compute node:
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
# export NCCL_IB_SL=1
# The management (Ethernet) interface for bootstrap and for gloo's CPU collectives:
# export NCCL_SOCKET_IFNAME=eth0
# export GLOO_SOCKET_IFNAME=eth0
# NVLink SHARP; some clusters need it off:
# export NCCL_NVLS_ENABLE=0
