"""The SGLang command lines the trainer and tools/eval.py start engines with, checked without starting any:
GPU layouts, the job seed, deterministic inference; and that SGLang's own parser reads them as meant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dapo_megatron import config as C
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.fleet import rollout_config
from dapo_megatron.rollout.placement import node_engine_gpus


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
    engines = eval_tool.eval_engines(job, Path("/models/policy"), tmp_path, device="cuda", gpus=8)
    commands = [engine.command() for engine in engines]
    assert [flag(c, "--base-gpu-id") for c in commands] == first_gpus
    assert {flag(c, "--tp-size") for c in commands} == {tp}
    assert {
        (c[2], flag(c, "--model-path"), flag(c, "--random-seed"), flag(c, "--dtype")) for c in commands
    } == {("sglang.launch_server", "/models/policy", str(job.seed), "auto")}
    assert len({flag(c, "--port") for c in commands}) == len(commands)


def test_eval_on_cpu_starts_one_engine_with_the_seed(eval_tool: ModuleType, tmp_path: Path) -> None:
    job = C.load(["seed=5"])
    [engine] = eval_tool.eval_engines(job, Path("/models/tiny"), tmp_path, device="cpu", gpus=0)
    command = engine.command()
    assert command[2] == "dapo_megatron.rollout.sglang_cpu" and flag(command, "--random-seed") == "5"


def test_layouts_that_do_not_fit_the_node_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"rollout.engine_tp_size=8 needs 8 GPUs per engine but this node has 4"
    ):
        node_engine_gpus(RolloutConfig(engine_tp_size=8), gpus=4)
    with pytest.raises(
        ValueError,
        match=r"rollout.num_engines=3 engines of .* need 12 GPUs but this node has 8; "
        r"set rollout.num_engines to at most 2",
    ):
        node_engine_gpus(RolloutConfig(engine_tp_size=4, num_engines=3), gpus=8)
    assert node_engine_gpus(RolloutConfig(engine_tp_size=2, num_engines=3), gpus=8) == [0, 2, 4]


def test_the_trainer_engine_gets_the_job_seed_and_deterministic_inference_on_gpu() -> None:
    deterministic = rollout_config(C.load(["seed=7", "rollout.deterministic=true"]))
    cuda = SGLangEngine("m", deterministic, log_file="e.log", device="cuda").command()
    assert flag(cuda, "--random-seed") == "7" and "--enable-deterministic-inference" in cuda
    own_seed = rollout_config(C.load(["seed=7", "rollout.seed=3"]))
    cpu = SGLangEngine("m", own_seed, log_file="e.log", device="cpu").command()
    assert flag(cpu, "--random-seed") == "3" and "--enable-deterministic-inference" not in cpu
    assert (
        "--enable-deterministic-inference"
        not in SGLangEngine("m", own_seed, log_file="e.log", device="cuda").command()
    )
    with pytest.raises(ValueError, match=r"rollout.deterministic=true needs a CUDA GPU: .*torch_native"):
        SGLangEngine("m", deterministic, log_file="e.log", device="cpu")


def test_sglang_parses_the_commands_as_meant() -> None:
    """Flag names checked against the installed SGLang's parser (in a subprocess: importing it takes
    seconds)."""
    cfg = RolloutConfig(seed=11, deterministic=True, engine_tp_size=2, dtype="bfloat16")
    gpu = SGLangEngine("m", cfg, log_file="e.log", device="cuda", base_gpu_id=2).command()
    cpu = SGLangEngine("m", RolloutConfig(seed=11), log_file="e.log", device="cpu").command()
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
        engine = SGLangEngine("m", RolloutConfig(), log_file="e.log", device=device)
        assert engine._environment()["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "dapo_megatron.rollout.sglang_models"
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "my_models")
    engine = SGLangEngine("m", RolloutConfig(), log_file="e.log")
    assert engine._environment()["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "my_models"
