# shellcheck shell=bash
# The one file to edit for your cluster: container, mounts, NCCL/CUDA settings, paths. Sourced by
# slurm/job.sh (the batch step) and slurm/launch.sh (every node); values already in the environment win,
# so `GPUS_PER_NODE=4 sbatch ...` works without editing.

# --- container (pyxis/enroot) ---
# The image slurm/Dockerfile builds: SGLang's release image (SGLang and the torch it pins) plus Transformer
# Engine, megatron-core and this project's requirements, imported with enroot (slurm/README.md, "Container").
# Empty: run without a container (a prepared venv).
export CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
# Host paths mounted into the container, SRC:DST[,SRC:DST...]. Inside it only these (and the image) exist, so
# every path a job reads or writes must lie under one of them. The default mounts the repository at its own
# path (this file is sourced from its root, where jobs are submitted): it holds what the recipes use as
# written (models/, data/, outputs/, .cache/). A model, data set or output_dir elsewhere needs its filesystem
# added, at the same path, e.g. for model.hf_dir=/lustre/Qwen2.5-32B: "$PWD:$PWD,/lustre:/lustre". Outputs
# must be on a filesystem every node shares. slurm/job.sh refuses an argument naming an unmounted path.
export CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$PWD:$PWD}
export PYTHON=${PYTHON:-python}

# --- layout and caches (checkpoints and TensorBoard go to the recipe's output_dir, relative to the repo) ---
# Trainer ranks per node; by default the GPUs Slurm gave this node (--gpus-per-node).
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export HF_HOME=${HF_HOME:-$PWD/.cache/huggingface}
# torchrun's rendezvous port on the first node. Empty: 20000 + job id % 10000, one per job and below Linux's
# ephemeral range (32768-60999). Set it if your firewall allows another range.
export RDZV_PORT=${RDZV_PORT:-}

# --- CUDA / PyTorch ---
# Set for every process of the job (trainers, SGLang engines, reward workers), so only what suits all of them.
# Not here: CUDA_DEVICE_MAX_CONNECTIONS=1, which megatron's tensor-parallel overlap needs and an engine must not
# get; each trainer rank sets it before CUDA starts (dapo_megatron/distributed/layout.py, initialize).
# Not set at all: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. The engines' torch_memory_saver
# (--enable-memory-saver) refuses to start with it, and CUDA IPC of expandable-segment memory (the weight sync
# hands tensors to the engines that way) needs pidfd_getfd, which unprivileged containers deny.
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
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
