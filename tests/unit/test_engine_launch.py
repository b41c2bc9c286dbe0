"""The SGLang command lines and environments the trainer and tools/eval.py start engines with, checked
without starting any: GPU layouts, the seeds, deterministic inference, what of the trainer's environment an
engine does not get; and that SGLang's own parser and torch_memory_saver's own check read them as meant."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dapo_megatron import backends
from dapo_megatron import config as C
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.engine_env import WITHHELD_VARIABLES
from dapo_megatron.trainer import fleet as fleet_module
from dapo_megatron.trainer.fleet import EngineFleet, rollout_config


@pytest.fixture(scope="module")
def eval_tool() -> ModuleType:
    from dapo_megatron.commands import eval as eval_command

    return eval_command


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize(
    ("experiment", "tp", "first_gpus"),
    [
        ("dapo_qwen2.5_7b", "1", ["0", "1", "2", "3", "4", "5", "6", "7"]),
        ("dapo_qwen2.5_32b", "4", ["0", "4"]),
    ],
)
def test_eval_starts_the_recipes_engines_side_by_side_on_a_node(
    eval_tool: ModuleType, tmp_path: Path, experiment: str, tp: str, first_gpus: list[str]
) -> None:
    job = eval_tool.load_job(
        "/models/policy", [f"experiment={experiment}"]
    )  # the recipe's TP needs 4-8 ranks
    engines = eval_tool.eval_engines(job, Path("/models/policy"), tmp_path, backend=backends.CUDA, gpus=8)
    commands = [engine.command() for engine in engines]
    assert [flag(c, "--base-gpu-id") for c in commands] == first_gpus
    assert {flag(c, "--tp-size") for c in commands} == {tp}
    assert {(c[2], flag(c, "--model-path"), flag(c, "--dtype")) for c in commands} == {
        ("sglang.launch_server", "/models/policy", "auto")
    }
    # No two engines draw the same random stream.
    assert [flag(c, "--random-seed") for c in commands] == [str(job.seed + i) for i in range(len(commands))]
    assert len({flag(c, "--port") for c in commands}) == len(commands)


def test_eval_on_cpu_starts_one_engine_with_the_seed(eval_tool: ModuleType, tmp_path: Path) -> None:
    job = C.load(["seed=5"])
    [engine] = eval_tool.eval_engines(job, Path("/models/tiny"), tmp_path, backend=backends.CPU, gpus=0)
    command = engine.command()
    assert command[2] == "dapo_megatron.backends.sglang_cpu" and flag(command, "--random-seed") == "5"


def test_layouts_that_do_not_fit_the_node_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"rollout.engine_tp_size=8 needs 8 GPUs per engine but this node has 4"
    ):
        backends.CUDA.node_engine_gpus(4, engine_tp_size=8, num_engines=0)
    with pytest.raises(
        ValueError,
        match=r"rollout.num_engines=3 engines of .* need 12 GPUs but this node has 8; "
        r"set rollout.num_engines to at most 2",
    ):
        backends.CUDA.node_engine_gpus(8, engine_tp_size=4, num_engines=3)
    assert backends.CUDA.node_engine_gpus(8, engine_tp_size=2, num_engines=3) == [0, 2, 4]


def test_the_trainer_engine_gets_the_job_seed_and_deterministic_inference_on_gpu() -> None:
    deterministic = rollout_config(C.load(["seed=7", "rollout.deterministic=true"]))
    cuda = SGLangEngine("m", deterministic, log_file="e.log", backend=backends.CUDA).command()
    assert flag(cuda, "--random-seed") == "7" and "--enable-deterministic-inference" in cuda
    own_seed = rollout_config(C.load(["seed=7", "rollout.seed=3"]))
    cpu = SGLangEngine("m", own_seed, log_file="e.log", backend=backends.CPU).command()
    assert flag(cpu, "--random-seed") == "3" and "--enable-deterministic-inference" not in cpu
    assert (
        "--enable-deterministic-inference"
        not in SGLangEngine("m", own_seed, log_file="e.log", backend=backends.CUDA).command()
    )
    with pytest.raises(ValueError, match=r"rollout.deterministic=true needs a CUDA GPU: .*torch_native"):
        SGLangEngine("m", deterministic, log_file="e.log", backend=backends.CPU)


def test_sglang_parses_the_commands_as_meant() -> None:
    """Flag names checked against the installed SGLang's parser (in a subprocess: importing it takes
    seconds)."""
    cfg = RolloutConfig(seed=11, deterministic=True, engine_tp_size=2, dtype="bfloat16")
    gpu = SGLangEngine("m", cfg, log_file="e.log", backend=backends.CUDA, base_gpu_id=2).command()
    cpu = SGLangEngine("m", RolloutConfig(seed=11), log_file="e.log", backend=backends.CPU).command()
    code = (
        "import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
        "parser = argparse.ArgumentParser()\nServerArgs.add_cli_args(parser)\n"
        "fields = ('random_seed', 'enable_deterministic_inference', 'tp_size', 'base_gpu_id', 'dtype')\n"
        "print(json.dumps([[getattr(parser.parse_args(argv), f) for f in fields]"
        " for argv in json.loads(sys.argv[1])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps([gpu[3:], cpu[3:]])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [
        [11, True, 2, 2, "bfloat16"],
        [11, False, 1, 0, "float32"],
    ]


def test_engines_find_qwen2_in_the_projects_model_package_unless_the_user_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for device in ("cpu", "cuda"):
        engine = SGLangEngine("m", RolloutConfig(), log_file="e.log", backend=backends.named(device))
        assert engine._environment()["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "dapo_megatron.rollout.sglang_models"
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "my_models")
    engine = SGLangEngine("m", RolloutConfig(), log_file="e.log")
    assert engine._environment()["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "my_models"


# What slurm/env.sh and megatron set for the trainer, and what an engine must not inherit.
TRAINER_ONLY = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "RANK": "3",
    "WORLD_SIZE": "128",
    "MASTER_ADDR": "node-0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job-1",
}
# What an engine needs from the same environment.
ENGINE_NEEDS = {
    "HF_HOME": "/lustre/cache/huggingface",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "NCCL_IB_TIMEOUT": "19",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "TRITON_CACHE_DIR": "/tmp/triton_cache_1_0",
}


@pytest.fixture
def trainer_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**TRAINER_ONLY, **ENGINE_NEEDS}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("trainer_environment")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_engine_gets_the_trainers_environment_without_the_trainers_own_settings(device: str) -> None:
    env = SGLangEngine("m", RolloutConfig(), log_file="e.log", backend=backends.named(device))._environment()
    assert sorted(set(TRAINER_ONLY) & set(env)) == []
    assert {name: env.get(name) for name in ENGINE_NEEDS} == ENGINE_NEEDS
    assert env["PATH"] == os.environ["PATH"]
    # Every variable withheld says why, in one place.
    assert set(TRAINER_ONLY) - {"TORCHELASTIC_RUN_ID"} <= WITHHELD_VARIABLES.keys()
    assert all(reason for reason in WITHHELD_VARIABLES.values())


@pytest.mark.usefixtures("trainer_environment")
def test_torch_memory_saver_starts_in_a_gpu_engines_environment_and_not_in_the_trainers() -> None:
    """Its own start-up check (`torch_memory_saver.entrypoint._sanity_checks`, run when
    `--enable-memory-saver` loads it), in a subprocess with each environment."""
    check = "from torch_memory_saver.entrypoint import _sanity_checks; _sanity_checks()"
    engine_env = SGLangEngine("m", RolloutConfig(), log_file="e.log", backend=backends.CUDA)._environment()
    runs = {
        name: subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
        for name, env in (("trainer", dict(os.environ)), ("engine", engine_env))
    }
    assert "expandable_segments is not supported" in runs["trainer"].stderr
    assert runs["engine"].returncode == 0, runs["engine"].stderr[-2000:]


def test_each_engine_of_a_job_samples_from_its_own_seed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fleet's engines, as the ranks that own them make them (not started); the per-sample seeds of
    rollout.deterministic keep deriving from the rollout seed itself."""
    launched: list[SGLangEngine] = []

    class Unstarted(SGLangEngine):
        def launch(self) -> SGLangEngine:
            launched.append(self)
            return self

    monkeypatch.setattr(fleet_module, "SGLangEngine", Unstarted)
    job = C.load(
        ["seed=7", "rollout.num_engines=4", f"output_dir={tmp_path}", "model.hf_dir=m"], world_size=4
    )
    for rank in range(4):
        fleet = EngineFleet(
            job, rank=rank, world_size=4, local_rank=rank, master_addr="127.0.0.1", backend=backends.CPU
        )
        fleet.launch()
    assert [flag(engine.command(), "--random-seed") for engine in launched] == ["7", "8", "9", "10"]
    assert rollout_config(job).seed == 7  # the base of every sample's seed (rollout/client.sample_seed)
    own = dataclasses.replace(rollout_config(job), seed=3)
    assert [own.engine_seed(index) for index in range(3)] == [3, 4, 5]
    assert RolloutConfig(seed=None).engine_seed(2) is None  # SGLang draws one
