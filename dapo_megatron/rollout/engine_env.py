"""The environment an SGLang engine starts with: the trainer's, less what belongs to the trainer's launcher
and device settings (each withheld variable with its reason), plus what the device backend adds
(`Backend.engine_environment`)."""

from __future__ import annotations

from collections.abc import Mapping

_LAUNCHER_REASON = (
    "torchrun's / srun's rendezvous: SGLang initialises torch.distributed from the same variables and would "
    "wait forever for the trainer's world size worth of ranks"
)
WITHHELD_VARIABLES: dict[str, str] = {
    **dict.fromkeys(
        (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
            "MASTER_ADDR",
            "MASTER_PORT",
        ),
        _LAUNCHER_REASON,
    ),
    "PYTORCH_CUDA_ALLOC_CONF": (
        "the trainer's allocator settings; with expandable_segments:True torch_memory_saver, which "
        "--enable-memory-saver loads, refuses to start (torch_memory_saver/entrypoint.py, _sanity_checks), "
        "and a CUDA tensor in expandable segments reaches another process only through pidfd_getfd, which "
        "unprivileged containers deny"
    ),
    "PYTORCH_ALLOC_CONF": (
        "the same settings under torch's newer name, which torch_memory_saver does not check"
    ),
    "CUDA_DEVICE_MAX_CONNECTIONS": (
        "megatron's tensor-parallel overlap orders its kernels through one hardware queue (1, set by each "
        "trainer rank: distributed/layout.py); an engine's kernels and NCCL are not to be serialised by it. "
        "SGLang 0.5.23's launch_server sets its own (8, entrypoints/engine.py _set_envs_and_config), so this "
        "keeps the trainer's value from any engine start that does not"
    ),
}
"""Variables of the trainer's environment an engine does not get, each with why; every other one it inherits
(PATH, HF_HOME, CUDA_VISIBLE_DEVICES, NCCL_* and the rest of slurm/env.sh)."""
WITHHELD_PREFIXES = ("TORCHELASTIC_",)
"""torchrun's agent state: the launcher's, as above."""


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without `WITHHELD_VARIABLES` and `WITHHELD_PREFIXES`. Built on purpose, not inherited
    wholesale: the trainer's launcher and its device settings are not an engine's."""
    return {
        k: v
        for k, v in environ.items()
        if k not in WITHHELD_VARIABLES and not k.startswith(WITHHELD_PREFIXES)
    }
