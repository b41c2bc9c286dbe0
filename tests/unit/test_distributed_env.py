"""Process placement from torchrun / Slurm variables, and the CPU compatibility layer's scope."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dapo_megatron.distributed.launch import first_host, process_env


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node001", "node001"),
        ("gpu-[012-015,020]", "gpu-012"),
        ("h100-[7,9]", "h100-7"),
        ("a[1-2],b3", "a1"),
        ("dgx-a-[0003-0004]", "dgx-a-0003"),
    ],
)
def test_first_host_of_a_slurm_nodelist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_torchrun_variables_win() -> None:
    env = process_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
            "MASTER_ADDR": "n1",
            "GROUP_RANK": "1",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_NODEID": "0",
        }
    )
    assert (
        env.rank,
        env.world_size,
        env.local_rank,
        env.master_addr,
        env.master_port,
        env.launcher,
        env.node,
    ) == (3, 8, 3, "n1", 1234, "torchrun", 1)


def test_srun_one_task_per_gpu() -> None:
    env = process_env(
        {
            "SLURM_PROCID": "13",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "5",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NODELIST": "h100-[001-002]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher, env.node) == (
        13,
        16,
        5,
        "h100-001",
        "slurm",
        1,
    )
    assert env.master_port == 20000 + 4242


def test_single_process_without_a_launcher() -> None:
    env = process_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single") and env.master_port > 0


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_cpu_compat_is_scoped_to_megatron_modules() -> None:
    out = _run(
        "import torch\nfrom dapo_megatron.backends import cpu_compat\ncpu_compat.apply()\n"
        "import megatron.core.pipeline_parallel.schedules as s\nimport megatron.core.transformer.utils as u\n"
        "print(s.torch is torch, torch.zeros(1, device='cpu').device, u.get_default_causal_mask(3).device)\n"
        "try:\n    torch.zeros(1, device='cuda')\nexcept (AssertionError, RuntimeError):\n"
        "    print('real torch untouched')\n"
    )
    assert out.split() == ["False", "cpu", "cpu", "real", "torch", "untouched"]


def test_cpu_compat_does_nothing_when_cuda_exists() -> None:
    out = _run(
        "import torch\ntorch.cuda.is_available = lambda: True\n"
        "from dapo_megatron.backends import cpu_compat\ncpu_compat.apply()\n"
        "import megatron.core.pipeline_parallel.schedules as s\n"
        "import megatron.core.tensor_parallel.random as r\n"
        "print(s.torch is torch, r._set_cuda_rng_state.__module__)\n"
    )
    assert out.split() == ["True", "megatron.core.tensor_parallel.random"]
